"""The `sdpa` attention backend (the default): torch's `scaled_dot_product_attention` with a bool mask.

torch picks its fastest kernel for the inputs (flash, memory-efficient, cuDNN, or the math fallback on CPU).
Grouped-query attention uses `enable_gqa` where torch has it (2.5+) and repeats the kv heads otherwise.
Query rows whose mask is all False are given a harmless all-True row for the call (so no kernel ever sees a
fully masked row, which some produce NaN for) and their output is set to zero afterwards; on a CPU whose torch
already gives zeros for such rows (checked once per dtype: `zeroes_fully_masked_rows`) the mask goes in unguarded,
saving the guard's five operations per layer (a drafter's step on a CPU is bound by operation count), as the
additive float mask SDPA would make of it, made once for all the layers of a forward (`additive_mask`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mmspec.attention.eager import expand_kv, rows_with_keys


def _torch_has_enable_gqa() -> bool:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


_HAS_GQA = _torch_has_enable_gqa()


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """q [B, H, S, D], k and v [B, Hkv, T, D], mask [B, 1|H, S, T] bool or None -> [B, H, S, D]."""
    num_heads, num_kv = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv
    if gqa and not _HAS_GQA:
        k, v = expand_kv(k, num_heads), expand_kv(v, num_heads)  # [B, H, T, D]
        gqa = False
    extra = {"enable_gqa": True} if gqa else {}
    if k.shape[2] == 0:  # no keys at all: every row is fully masked
        return q.new_zeros(q.shape)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **extra)
    if eager_cpu_inference(q) and zeroes_fully_masked_rows(q.dtype):
        additive = additive_mask(mask, q.dtype)  # [B, 1|H, S, T] what SDPA makes of the bool mask, once per forward
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale, **extra)  # [B, H, S, D]
    has_key = rows_with_keys(mask)  # [B, 1|H, S, 1]
    safe_mask = mask | ~has_key  # [B, 1|H, S, T]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe_mask, scale=scale, **extra)  # [B, H, S, D]
    return out.masked_fill(~has_key, 0.0)


def eager_cpu_inference(q: torch.Tensor) -> bool:
    """Whether the unguarded path may run: on a CPU, without autograd, and not inside torch.compile (whose traced
    graph makes the guard's operations in one fused kernel; the unguarded path's mask cache, compared by storage,
    and the once-per-dtype check, which makes a generator, would break the graph: every layer ran eagerly between
    compiled pieces and EAGLE's drafter forward fell back to eager whole)."""
    return q.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


_LAST_ADDITIVE: tuple = (None, 0, None)  # (a bool mask, its version, its additive form): one forward's layers share it


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive float mask [B, 1|H, S, T] (0 where `mask` is True, -inf where False) that SDPA builds from a
    bool mask on every call, made once: the last one is reused while the same mask comes again (same storage,
    shape and strides, not modified in place since), as it does for every layer of a forward. Bit-identical
    results (tested); saves SDPA's three conversion operations on every layer but the first."""
    last, version, additive = _LAST_ADDITIVE  # one read: another thread may replace the tuple, never half of it
    if (last is not None and additive.dtype == dtype and version == mask._version
            and last.data_ptr() == mask.data_ptr() and last.shape == mask.shape and last.stride() == mask.stride()):
        return additive
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    globals()["_LAST_ADDITIVE"] = (mask, mask._version, additive)
    return additive


@functools.cache
def zeroes_fully_masked_rows(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU `scaled_dot_product_attention` returns zeros (not NaN) for a query row whose mask
    hides every key, given the additive mask the unguarded path passes (`additive_mask`), with grouped-query
    attention or without: then the guard above is not needed."""
    with torch.no_grad():
        q = torch.randn(1, 4, 3, 8, generator=torch.Generator().manual_seed(0)).to(dtype)  # [B, H, S, D]
        k = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(1)).to(dtype)  # [B, Hkv, T, D]
        hidden = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
        hidden[..., 1, :] = True  # query row 1 sees nothing
        mask = torch.zeros(1, 1, 3, 5, dtype=dtype).masked_fill_(hidden, float("-inf"))  # as additive_mask makes it
        outs = [F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1),
                                               attn_mask=mask)]
        if _HAS_GQA:
            outs.append(F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True))
    return all(bool((out[:, :, 1] == 0).all()) and bool(out.isfinite().all()) for out in outs)
