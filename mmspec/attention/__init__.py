"""The attention backend registry: one call, `attend`, for causal, ragged (per-row length) and tree masks.

    out = attend(q, k, v, mask, backend="sdpa")

q [B, H, S, D]; k, v [B, Hkv, T, D] with H a multiple of Hkv (grouped-query attention); mask a bool tensor,
True = may attend, shaped [B, S, T], [B, 1, S, T] or [B, H, S, T] (a leading 1 instead of B broadcasts over
the batch), or None to attend to every key. Returns [B, H, S, D] in q's dtype. A query row whose mask is all
False (a padded query) outputs zeros, never NaN, whatever the backend.

Backends (`available_backends()` lists the ones usable for a device):

- `eager`: explicit float32 softmax; the reference. Always usable.
- `sdpa` (the default): `torch.nn.functional.scaled_dot_product_attention`. Always usable.
- `xformers`: `xformers.ops.memory_efficient_attention`; needs xformers installed and CUDA tensors.
- `triton`: `mmspec.kernels.tree_attention` (flash-style, reads the mask tile by tile); needs Triton and
  CUDA tensors, or `TRITON_INTERPRET=1` (CPU, for tests).

`attend` checks shapes only (no host synchronisation), normalises the mask to [B, 1|H, S, T] and calls the
backend as `fn(q, k, v, mask, scale)`. Plug in your own with `register_backend(name, fn, available=...)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmspec.attention.eager import eager_attention, expand_kv
from mmspec.attention.sdpa import sdpa_attention
from mmspec.attention.triton_backend import triton_attention, triton_unusable_reason, triton_usable
from mmspec.attention.xformers_backend import xformers_attention, xformers_available
from mmspec.errors import InputError

__all__ = [
    "AttentionFn",
    "attend",
    "register_backend",
    "available_backends",
    "check_backend_usable",
    "registered_backends",
    "get_backend",
    "set_default_backend",
    "default_backend",
    "expand_kv",
]

# fn(q [B, H, S, D], k [B, Hkv, T, D], v [B, Hkv, T, D], mask [B, 1|H, S, T] bool | None, scale) -> [B, H, S, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]
# available(device) -> whether the backend can run on tensors living on that device
AvailableFn = Callable[[torch.device], bool]
# a fixed hint, or hint(device) -> why the backend cannot run on that device
Hint = str | Callable[[torch.device], str]


@dataclass(frozen=True)
class _Backend:
    fn: AttentionFn
    available: AvailableFn
    unavailable_hint: Hint


def _always(device: torch.device) -> bool:
    return True


_BACKENDS: dict[str, _Backend] = {}
_DEFAULT = "sdpa"


def register_backend(name: str, fn: AttentionFn, *, available: AvailableFn | None = None,
                     unavailable_hint: Hint = "") -> None:
    """Register (or replace) backend `name`.

    `fn(q, k, v, mask, scale)` receives validated inputs: q [B, H, S, D], k and v [B, Hkv, T, D], mask
    [B, 1|H, S, T] bool or None, scale a float; it returns [B, H, S, D] in q's dtype and zeros for query
    rows whose mask is all False. `available(device)` says whether it can run on that device (default:
    always); `unavailable_hint` (a string, or a function of the device returning one) is appended to the
    error raised when it cannot.
    """
    if not isinstance(name, str) or not name:
        raise InputError(f"backend name must be a non-empty string, got {name!r}.")
    if not callable(fn):
        raise InputError(f"backend {name!r}: fn must be callable, got {type(fn).__name__}.")
    _BACKENDS[name] = _Backend(fn, available or _always, unavailable_hint)


def registered_backends() -> list[str]:
    """Every registered backend name, usable here or not."""
    return list(_BACKENDS)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The registered backends that can run on tensors living on `device` in this process."""
    dev = torch.device(device)
    return [name for name, entry in _BACKENDS.items() if entry.available(dev)]


def _lookup(name: str) -> _Backend:
    entry = _BACKENDS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise InputError(
            f"unknown attention backend {name!r}; known backends: {', '.join(sorted(_BACKENDS))}. "
            "Register new ones with mmspec.attention.register_backend(name, fn)."
        )
    return entry


def _require_available(name: str, entry: _Backend, device: torch.device) -> None:
    """InputError naming why backend `name` cannot run on `device` and what can, if it cannot."""
    if not entry.available(device):
        hint = entry.unavailable_hint(device) if callable(entry.unavailable_hint) else entry.unavailable_hint
        hint = f" {hint}" if hint else ""
        raise InputError(f"attention backend {name!r} cannot run on {device} tensors here.{hint} "
                         f"Usable here: {', '.join(available_backends(device))}.")


def check_backend_usable(name: str, device: torch.device | str) -> _Backend:
    """Backend `name`'s entry; InputError if there is none or it cannot run on `device`."""
    entry = _lookup(name)
    _require_available(name, entry, torch.device(device))
    return entry


def get_backend(name: str) -> AttentionFn:
    """The function of backend `name` (InputError listing the known names if there is none)."""
    return _lookup(name).fn


def set_default_backend(name: str) -> None:
    """Make `name` the backend `attend` uses when called without `backend=`."""
    global _DEFAULT
    _lookup(name)
    _DEFAULT = name


def default_backend() -> str:
    """The name of the backend `attend` uses when called without `backend=`."""
    return _DEFAULT


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor | None:
    """Validate shapes, dtypes and devices; return the mask as [B, 1|H, S, T] (or None)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            layout = "[B, H, S, D]" if name == "q" else "[B, Hkv, T, D]"
            raise InputError(f"{name} must be 4-D {layout}, got shape {_shape(t)}.")
        if not t.is_floating_point():
            raise InputError(f"{name} must be a floating-point tensor, got {t.dtype}.")
    b, h, s, d = q.shape
    if k.shape != v.shape:
        raise InputError(
            f"k and v must have the same shape [B, Hkv, T, D], got {_shape(k)} and {_shape(v)}."
        )
    bk, hkv, t, dk = k.shape
    if bk != b:
        raise InputError(f"q has batch {b} but k/v have batch {bk}; they must match.")
    if dk != d:
        raise InputError(f"q has head dim D={d} but k/v have D={dk}; they must match.")
    if hkv == 0 or h % hkv != 0:
        raise InputError(
            f"q has {h} heads, k/v have {hkv}: the query heads must be a multiple of the kv heads (GQA)."
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first.")
    if k.device != q.device or v.device != q.device:
        raise InputError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}.")
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise InputError(f"mask must be a bool torch.Tensor or None, got {type(mask).__name__}.")
    if mask.dtype != torch.bool:
        raise InputError(
            f"mask must be bool (True = may attend), got {mask.dtype}; "
            "turn an additive float mask into one with `mask == 0`."
        )
    if mask.device != q.device:
        raise InputError(f"mask is on {mask.device} but q is on {q.device}; move it to q's device.")
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)  # [B, 1, S, T]
    ok = (
        mask.dim() == 4
        and mask.shape[0] in (1, b)
        and mask.shape[1] in (1, h)
        and mask.shape[2] == s
        and mask.shape[3] == t
    )
    if not ok:
        raise InputError(
            f"mask has shape {_shape(mask)}; expected [B, S, T], [B, 1, S, T] or [B, H, S, T] = "
            f"[{b}, {s}, {t}], [{b}, 1, {s}, {t}] or [{b}, {h}, {s}, {t}] (B may be 1 to broadcast)."
        )
    if mask.shape[0] != b:
        mask = mask.expand(b, *mask.shape[1:])  # [B, 1|H, S, T]
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
           backend: str | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention through the named backend (default: `default_backend()`, initially `sdpa`).

    q [B, H, S, D]; k, v [B, Hkv, T, D]; mask bool [B, S, T] / [B, 1, S, T] / [B, H, S, T] (True = may
    attend) or None; scale defaults to 1/sqrt(D). Returns [B, H, S, D] in q's dtype; fully masked query rows
    give zeros. No host synchronisation.
    """
    name = _DEFAULT if backend is None else backend
    entry = _lookup(name)
    mask4 = _check_inputs(q, k, v, mask)  # [B, 1|H, S, T] | None
    _require_available(name, entry, q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise InputError(f"scale must be a float or None (1/sqrt(D)), got {scale!r}.")
    return entry.fn(q, k, v, mask4, float(scale))


register_backend("eager", eager_attention)
register_backend("sdpa", sdpa_attention)
register_backend(
    "xformers",
    xformers_attention,
    available=xformers_available,
    unavailable_hint="The xformers backend needs CUDA tensors and `pip install mmspec[xformers]`.",
)
register_backend(
    "triton",
    triton_attention,
    available=triton_usable,
    unavailable_hint=triton_unusable_reason,
)
