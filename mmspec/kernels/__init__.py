"""Triton kernels of the shared core, and the helpers that say whether they can run here.

Each kernel module holds one Triton kernel, its launcher (the public function) and a pointer to its
pure-PyTorch twin:

| module | launcher | twin |
|---|---|---|
| `mmspec.kernels.tree_attention` | `tree_attention`, `tree_attention_structured` | the `eager` attention backend |
| `mmspec.kernels.rejection` | `rejection_sample_chain` | `mmspec.verify.chain.verify_chain_lossless` |

A kernel runs compiled on CUDA tensors, or in Triton's interpreter on CPU tensors, which is how the tests
compare kernels with their twins on machines without a GPU. Triton decides at `import triton` time whether
its own library functions (`tl.max`, `tl.sum`, `tl.zeros`, ...) are interpreted, so `TRITON_INTERPRET=1`
must be in the environment BEFORE triton is first imported (by anyone: torch.compile imports it too). Set
it in the shell, or at the top of the test suite's root `conftest.py`. If it is set too late the launchers
raise an `InputError` that says so, instead of failing deep inside Triton.

This module imports nothing heavy: `triton_available()` tries the import once and caches the answer.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from mmspec.errors import InputError

__all__ = [
    "triton_available",
    "interpreter_mode",
    "interpreter_requested",
    "can_run_triton",
    "require_triton",
    "lazy_jit",
]


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when `triton` can be imported (it is Linux-only and optional)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return True


def interpreter_requested() -> bool:
    """True when the environment asks for Triton's interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=1)
def _triton_imported_for_interpreter() -> bool:
    """Whether triton's library functions were set up for the interpreter when triton was imported.

    Fixed for the life of the process once triton is imported (this function imports it), hence cached.
    """
    try:
        import triton.language.standard as standard
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:
        return False
    return isinstance(standard.zeros, InterpretedFunction)


def interpreter_mode() -> bool:
    """True when kernels run in Triton's interpreter (on CPU tensors): requested, and triton imported so."""
    return interpreter_requested() and triton_available() and _triton_imported_for_interpreter()


def can_run_triton(device: torch.device | str) -> bool:
    """Whether a Triton kernel can run on tensors living on `device` in this process."""
    if not triton_available():
        return False
    if interpreter_mode():
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def require_triton(what: str, device: torch.device | str) -> None:
    """Raise a clear `InputError` unless `what` (a kernel or backend name) can run on `device`."""
    if not triton_available():
        raise InputError(
            f"{what} needs Triton, which is not importable here; install it (`pip install triton`, Linux only) "
            "or use a PyTorch backend/twin instead."
        )
    if can_run_triton(device):
        return
    if interpreter_requested():
        raise InputError(
            f"{what}: TRITON_INTERPRET=1 is set but triton was imported before it was, so Triton is not in "
            "interpreter mode. Set TRITON_INTERPRET=1 before anything imports triton (in the shell, or at the "
            "top of the test suite's root conftest.py)."
        )
    raise InputError(
        f"{what} needs CUDA tensors (got tensors on {torch.device(device)}); on CPU it only runs in "
        "Triton's interpreter, for testing: set TRITON_INTERPRET=1 before triton is first imported. "
        "Otherwise use its PyTorch twin."
    )


class lazy_jit:  # noqa: N801 - used like a decorator
    """Decorator for the kernels: build the Triton kernel on first launch, once per interpreter setting.

    Importing a kernel module therefore does not import triton (so `TRITON_INTERPRET` may still be set after
    importing mmspec, as long as it is before the first launch or other triton import), and the module loads
    where triton is not installed. On first use it puts `triton.language` into the module's globals as `tl`
    (the kernel body reads it from there) and wraps the function the way `triton.jit` does, in the mode triton
    itself is in. `kernel[grid](...)` works as with `triton.jit`.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._built: dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def get(self) -> Any:
        """The `JITFunction` (compiled mode) or `InterpretedFunction` (interpreter mode) of the kernel."""
        mode = interpreter_mode()
        kernel = self._built.get(mode)
        if kernel is None:
            import triton.language

            self.fn.__globals__["tl"] = triton.language
            if mode:
                from triton.runtime.interpreter import InterpretedFunction

                kernel = InterpretedFunction(self.fn)
            else:
                from triton.runtime.jit import JITFunction

                kernel = JITFunction(self.fn)
            self._built[mode] = kernel
        return kernel

    def __getitem__(self, grid: Any) -> Any:
        return self.get()[grid]
