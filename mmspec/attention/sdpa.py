"""The `sdpa` attention backend (the default): torch's `scaled_dot_product_attention` with a bool mask.

torch picks its fastest kernel for the inputs (flash, memory-efficient, cuDNN, or the math fallback on CPU).
Grouped-query attention uses `enable_gqa` where torch has it (2.5+) and repeats the kv heads otherwise.
Query rows whose mask is all False are given a harmless all-True row for the call (so no kernel ever sees a
fully masked row, which some produce NaN for) and their output is set to zero afterwards.
"""

from __future__ import annotations

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
    has_key = rows_with_keys(mask)  # [B, 1|H, S, 1]
    safe_mask = mask | ~has_key  # [B, 1|H, S, T]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe_mask, scale=scale, **extra)  # [B, H, S, D]
    return out.masked_fill(~has_key, 0.0)
