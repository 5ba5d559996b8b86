"""Error types and argument checks shared by every public entry point.

Public functions validate their inputs here and raise `InputError` with a message that names the argument,
says what is wrong and what to do. The pure tensor functions that run in the hot path (and must compile with
`torch.compile(fullgraph=True)`) never call these: their public wrappers do, once, before the work starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a check needs it: `mmspec --help` and the CLI's errors stay fast
    import torch


class MMSpecError(Exception):
    """Base class of every error mmspec raises on purpose."""


class InputError(MMSpecError, ValueError):
    """An argument a user passed is wrong; the message names it and says how to fix it."""


class CheckpointError(MMSpecError):
    """A checkpoint could not be loaded safely or does not match the architecture."""


def check(condition: bool, message: str) -> None:
    """Raise `InputError(message)` unless `condition` holds."""
    if not condition:
        raise InputError(message)


def why_not_a_file(path: os.PathLike | str) -> str:
    """What is wrong with a path that should be a file: "is a folder, not a file" or "does not exist"."""
    return "is a folder, not a file" if os.path.isdir(path) else "does not exist"


def check_probability(name: str, value: float, *, low_open: bool = True, high_closed: bool = True) -> None:
    """Check a scalar lies in (0, 1] (default) or the interval given by the flags."""
    ok_low = value > 0 if low_open else value >= 0
    ok_high = value <= 1 if high_closed else value < 1
    lo = "(" if low_open else "["
    hi = "]" if high_closed else ")"
    check(ok_low and ok_high, f"{name} must be in {lo}0, 1{hi}, got {value!r}.")


def check_nonnegative(name: str, value: float) -> None:
    check(value >= 0, f"{name} must be >= 0, got {value!r}.")


def check_float_dtype(dtype: object) -> None:
    """dtype must be a floating torch.dtype (e.g. what a model is converted to)."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")


def check_positive_int(name: str, value: int, minimum: int = 1) -> None:
    check(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be an integer >= {minimum}, got {value!r}.",
    )


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device if it is cpu, or cuda where torch sees a CUDA device (InputError otherwise)."""
    import torch

    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    check(resolved is not None and resolved.type in ("cpu", "cuda"), f"device must be cpu or cuda, got {device!r}.")
    check(resolved.type != "cuda" or torch.cuda.is_available(),
          "device 'cuda' was asked for but torch sees no CUDA device; use --device cpu.")
    return resolved


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None], what: str = "") -> None:
    """Check `tensor.shape` against `expected`, where None matches any size.

    `what` describes the expected layout for the message, e.g. "[B, K] (batch, draft length)".
    """
    import torch

    check(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    shape = tuple(tensor.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        layout = f" {what}" if what else ""
        raise InputError(f"{name} has shape {list(shape)}, expected {want}{layout}.")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Reject NaN (and +inf) values; -inf is allowed in logits (masked tokens).

    This synchronises with the device once; call it at API boundaries, not in the hot path.
    """
    import torch

    bad = torch.isnan(tensor) | (tensor == float("inf"))
    if bool(bad.any()):
        n = int(bad.sum())
        raise InputError(
            f"{name} contains {n} NaN/+inf value(s). Check the model's dtype (fp16 overflow?) and inputs; "
            "-inf is only allowed as a mask value."
        )


def check_distribution(name: str, probs: torch.Tensor, atol: float = 1e-3) -> None:
    """Check a probability tensor is finite, non-negative and sums to 1 over its last axis."""
    import torch

    check_finite(name, probs)
    if bool((probs < 0).any()):
        raise InputError(f"{name} has negative entries; pass probabilities (softmax output), not logits.")
    sums = probs.sum(-1)
    if not bool(torch.allclose(sums, torch.ones_like(sums), atol=atol)):
        worst = float((sums - 1).abs().max())
        raise InputError(
            f"{name} does not sum to 1 over its last axis (max deviation {worst:.3g}); "
            "pass normalised probabilities (e.g. torch.softmax(logits, -1))."
        )
