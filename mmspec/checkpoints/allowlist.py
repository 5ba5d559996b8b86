"""The allow-list of non-tensor Python objects that safe (`weights_only`) loading accepts.

`torch.load(..., weights_only=True)` only rebuilds tensors, containers and plain Python values. The official
checkpoints mmspec converts also store a few harmless objects next to the weights; they are listed here, each
with the reason it is needed, and nothing else is accepted without an explicit opt-in:

- `argparse.Namespace`: MAR's `checkpoint-last.pth` stores its training arguments under `'args'`.
- numpy scalars (`numpy._core.multiarray.scalar`, and the numpy 1.x name `numpy.core.multiarray.scalar`),
  `numpy.dtype` and the concrete numeric/bool/str/bytes/datetime dtype classes (`numpy.dtypes.Int64DType`, ...):
  training scripts store `np.int64` epochs, `np.float64` losses or learning rates. A pickled numpy scalar calls
  `scalar(dtype, bytes)`, and the dtype is rebuilt by `numpy.dtype(...)` and then has its state set, which the
  unpickler only permits for allow-listed classes, hence the concrete dtype classes.
- `numpy.ndarray` with `numpy._core.multiarray._reconstruct` (and its numpy 1.x name): small arrays such as
  RNG states. The object and void dtype classes are deliberately left out, so object arrays (which would hold
  arbitrary pickled objects) are still refused.

Each entry is either a callable (matched by its `module.qualname`) or a `(callable, "dotted.name")` pair, the
form `torch.serialization.safe_globals` accepts for objects whose pickled name differs from where they live.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from mmspec.errors import InputError

SafeGlobal = Callable[..., Any] | tuple[Callable[..., Any], str]

# numpy dtype characters whose concrete dtype classes hold only plain data: bool, integers, floats,
# complex, bytes, str, datetime64, timedelta64. Object ("O") and void ("V") are left out on purpose.
_PLAIN_DTYPE_CHARS = "?bBhHiIlLqQefdgFDGSUmM"

# where numpy's `multiarray` module is pickled from: numpy >= 2 writes `numpy._core`, numpy 1.x `numpy.core`
_MULTIARRAY_NAMES = ("numpy._core.multiarray", "numpy.core.multiarray")


def default_safe_globals() -> list[SafeGlobal]:
    """The objects mmspec allows on top of torch's own `weights_only` set (see the module docstring)."""
    return [argparse.Namespace, *_numpy_safe_globals()]


def _numpy_multiarray() -> ModuleType | None:
    """numpy's multiarray module under its current name, without touching the deprecated `numpy.core`."""
    for name in _MULTIARRAY_NAMES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _numpy_safe_globals() -> list[SafeGlobal]:
    try:
        import numpy as np
    except ImportError:  # numpy is optional for loading: without it no file can reference it usefully
        return []
    multiarray = _numpy_multiarray()
    found: list[SafeGlobal] = [np.dtype, np.ndarray]
    found += sorted({type(np.dtype(c)) for c in _PLAIN_DTYPE_CHARS}, key=lambda t: t.__name__)
    if multiarray is not None:
        for module_name in _MULTIARRAY_NAMES:  # register both names: files saved by numpy 1.x and 2.x
            found.append((multiarray.scalar, f"{module_name}.scalar"))
            found.append((multiarray._reconstruct, f"{module_name}._reconstruct"))
    return found


def check_extra_safe_globals(extra: Iterable[SafeGlobal]) -> list[SafeGlobal]:
    """Validate `extra_safe_globals`: callables/classes or `(callable, "dotted.name")` pairs."""
    if isinstance(extra, (str, bytes)) or not isinstance(extra, Iterable):
        raise InputError(
            f"extra_safe_globals must be a list of classes/functions (or (object, 'dotted.name') pairs), "
            f"got {type(extra).__name__}."
        )
    items = list(extra)
    for item in items:
        pair_ok = isinstance(item, tuple) and len(item) == 2 and callable(item[0]) and isinstance(item[1], str)
        if not (pair_ok or (callable(item) and not isinstance(item, tuple))):
            raise InputError(
                f"extra_safe_globals entry {item!r} is neither a class/function nor an (object, 'dotted.name') "
                "pair; pass the class itself, e.g. extra_safe_globals=[pathlib.PosixPath]."
            )
    return items
