"""The `xformers` attention backend: `xformers.ops.memory_efficient_attention` on CUDA tensors.

Only usable when xformers is importable (`pip install mmspec[xformers]`) and the tensors are on CUDA; the
registry checks both and raises a clear `InputError` otherwise. The bool mask becomes an additive bias
(0 / -inf) allocated with its last dimension padded to a multiple of 8, as xformers requires for alignment.
Fully masked query rows output zeros, as with every backend.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from mmspec.attention.eager import expand_kv, rows_with_keys


@functools.lru_cache(maxsize=1)
def xformers_importable() -> bool:
    """True when `xformers.ops` can be imported."""
    if importlib.util.find_spec("xformers") is None:
        return False
    try:
        import xformers.ops  # noqa: F401
    except Exception:
        return False
    return True


def xformers_available(device: torch.device) -> bool:
    """The backend runs only with xformers installed and CUDA tensors."""
    return torch.device(device).type == "cuda" and xformers_importable()


def xformers_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """q [B, H, S, D], k and v [B, Hkv, T, D], mask [B, 1|H, S, T] bool or None -> [B, H, S, D]."""
    import xformers.ops as xops

    b, num_heads, s, _ = q.shape
    t = k.shape[2]
    if t == 0:
        return q.new_zeros(q.shape)
    k = expand_kv(k, num_heads)  # [B, H, T, D]
    v = expand_kv(v, num_heads)  # [B, H, T, D]
    bias = None
    has_key = None
    if mask is not None:
        has_key = rows_with_keys(mask)  # [B, 1|H, S, 1]
        safe_mask = (mask | ~has_key).expand(b, num_heads, s, t)  # [B, H, S, T]
        t_pad = (t + 7) // 8 * 8
        bias = q.new_zeros((b, num_heads, s, t_pad))[..., :t]  # [B, H, S, T], aligned storage
        bias.masked_fill_(~safe_mask, float("-inf"))
    out = xops.memory_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias, scale=scale
    ).transpose(1, 2)  # [B, H, S, D]
    if has_key is not None:
        out = out.masked_fill(~has_key, 0.0)
    return out
