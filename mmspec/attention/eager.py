"""The `eager` attention backend: the reference every other backend (and the Triton kernel) is tested against.

Explicit float32 math: scores = q k^T * scale, masked with -inf where the mask is False, softmax, times v.
A query row whose mask is all False outputs zeros (never NaN); the scores of such rows are zeroed before the
softmax so neither the forward nor the backward pass produces NaN.

Also holds the small helpers the other backends share (`expand_kv`, `rows_with_keys`).
"""

from __future__ import annotations

import torch


def expand_kv(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat the kv heads for grouped-query attention: [B, Hkv, T, D] -> [B, H, T, D].

    Head h of the output is kv head h // (H // Hkv) (the `repeat_interleave` layout of HF's `repeat_kv`).
    Returns `kv` itself when H == Hkv; otherwise a copy.
    """
    b, hkv, t, d = kv.shape
    if hkv == num_heads:
        return kv
    group = num_heads // hkv
    return kv[:, :, None].expand(b, hkv, group, t, d).reshape(b, num_heads, t, d)


def rows_with_keys(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, Hm, S, T] bool -> [B, Hm, S, 1] bool: True where the query row may attend to some key."""
    return mask.any(-1, keepdim=True)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Reference attention in float32.

    q [B, H, S, D], k and v [B, Hkv, T, D], mask [B, 1|H, S, T] bool (True = may attend) or None.
    Returns [B, H, S, D] in q's dtype.
    """
    num_heads = q.shape[1]
    qf = q.float()  # [B, H, S, D]
    kf = expand_kv(k.float(), num_heads)  # [B, H, T, D]
    vf = expand_kv(v.float(), num_heads)  # [B, H, T, D]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, H, S, T]
    if mask is None:
        return torch.matmul(torch.softmax(scores, dim=-1), vf).to(q.dtype)
    has_key = rows_with_keys(mask)  # [B, 1|H, S, 1]
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0)  # [B, H, S, T]
    probs = torch.softmax(scores, dim=-1) * has_key  # [B, H, S, T], fully masked rows all zero
    return torch.matmul(probs, vf).to(q.dtype)  # [B, H, S, D]
