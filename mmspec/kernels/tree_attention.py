"""Tree / ragged-mask attention: a flash-attention-style Triton forward kernel that reads a bool mask.

Speculative verification attends S query positions (a draft chain or a draft tree) to a KV cache whose rows
have different valid lengths, under a mask that is neither causal nor padded in a way the fused torch
kernels know about. This kernel does the online softmax over key blocks of `BLOCK_N` and reads the mask
tile by tile, so any mask works at flash-attention memory cost.

Two modes, one kernel:

- dense: `tree_attention(q, k, v, mask)` with mask [B, S, T] / [B, 1|H, S, T] bool (True = may attend);
- structured: `tree_attention_structured(q, k, v, prefix_len, tree_mask)`: keys `< prefix_len[b]` are
  visible to every query of row b, the S keys at `prefix_len[b] + j` are visible as `tree_mask[b, i, j]` says,
  and the rest is invisible. The key loop stops at `prefix_len[b] + S`, so a row pays for its own length,
  not the cache capacity T. `structured_mask` builds the equivalent dense mask.

GQA by index mapping (query head h reads kv head h // (H // Hkv)), no copy. Any head dim D <= 256 (padded to
a power of two >= 16 inside the kernel). Fully masked query rows output zeros.

PyTorch twin: the `eager` attention backend (`mmspec.attention.eager.eager_attention`), with
`structured_mask` for the structured mode. Tests compare them under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmspec.errors import InputError
from mmspec.kernels import interpreter_mode, lazy_jit, require_triton

# `triton.language`, put here by `lazy_jit` on the first launch; importing this module does not import triton
tl: Any = None

__all__ = ["tree_attention", "tree_attention_structured", "structured_mask"]

_MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634

_MODE_NONE, _MODE_DENSE, _MODE_STRUCTURED = 0, 1, 2


@lazy_jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, plen_ptr,
    s_qb, s_qh, s_qs, s_qd,
    s_kb, s_kh, s_kt, s_kd,
    s_vb, s_vh, s_vt, s_vd,
    s_ob, s_oh, s_os, s_od,
    s_mb, s_mh, s_ms, s_mt,
    s_pb,
    H, S, T, D, GROUP, qk_scale,
    MASK_MODE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kvh = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_ok = offs_m < S  # [BLOCK_M]
    d_ok = offs_d < D  # [BLOCK_D]

    q_base = q_ptr + b * s_qb + h * s_qh
    q = tl.load(q_base + offs_m[:, None] * s_qs + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:  # the interpreter's tl.dot is wrong for 16-bit floats: multiply their exact fp32 values
        q = q.to(tl.float32)
    k_base = k_ptr + b * s_kb + kvh * s_kh
    v_base = v_ptr + b * s_vb + kvh * s_vh
    m_base = m_ptr + b * s_mb + h * s_mh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running weighted sum of v

    if MASK_MODE == 2:
        prefix = tl.load(plen_ptr + b * s_pb)
        hi = tl.minimum(prefix + S, T)
    else:
        prefix = 0
        hi = T

    for start in range(0, hi, BLOCK_N):
        cols = start + offs_n  # [BLOCK_N] key positions
        col_ok = cols < hi  # [BLOCK_N]
        k = tl.load(k_base + cols[None, :] * s_kt + offs_d[:, None] * s_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if DOT_FP32:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 units
        if MASK_MODE == 1:
            tile = tl.load(m_base + offs_m[:, None] * s_ms + cols[None, :] * s_mt,
                           mask=row_ok[:, None] & col_ok[None, :], other=0)  # [BLOCK_M, BLOCK_N] uint8
            visible = tile != 0
        elif MASK_MODE == 2:
            tcol = cols - prefix  # [BLOCK_N] index into the tree mask
            in_tree = (tcol >= 0) & col_ok  # tcol < S follows from cols < prefix + S
            tile = tl.load(m_base + offs_m[:, None] * s_ms + tcol[None, :] * s_mt,
                           mask=row_ok[:, None] & in_tree[None, :], other=0)  # [BLOCK_M, BLOCK_N] uint8
            visible = (tile != 0) | ((cols < prefix) & col_ok)[None, :]
        else:
            visible = col_ok[None, :]  # [1, BLOCK_N], broadcast over query rows
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
        p = tl.exp2(qk - m_safe[:, None])  # [BLOCK_M, BLOCK_N], 0 where invisible
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * s_vt + offs_d[None, :] * s_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        p = p.to(v.dtype)  # probabilities rounded to the input precision, as flash attention does
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    has_key = l_i > 0.0  # [BLOCK_M]
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_D]; rows without keys: acc == 0
    o_base = o_ptr + b * s_ob + h * s_oh
    tl.store(o_base + offs_m[:, None] * s_os + offs_d[None, :] * s_od, out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InputError(f"{name} must be a 4-D tensor ([B, H, S, D] / [B, Hkv, T, D]).")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise InputError(f"{name} has dtype {t.dtype}; the triton kernel takes float16, bfloat16 or float32.")
    b, h, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise InputError(
            f"k and v must be [B, Hkv, T, D] = [{b}, Hkv, T, {d}] and equal, got {list(k.shape)}, {list(v.shape)}."
        )
    if k.shape[1] == 0 or h % k.shape[1] != 0:
        raise InputError(f"q has {h} heads, k/v have {k.shape[1]}: H must be a multiple of Hkv.")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if k.device != q.device or v.device != q.device:
        raise InputError("q, k, v must be on one device.")
    if not 0 < d <= _MAX_HEAD_DIM:
        raise InputError(f"head dim D={d} is not supported by the triton kernel (1..{_MAX_HEAD_DIM}); use sdpa.")


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: int, mask: torch.Tensor | None,
            prefix_len: torch.Tensor | None, scale: float | None, block_m: int | None,
            block_n: int | None) -> torch.Tensor:
    b, h, s, d = q.shape
    t = k.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, H, S, D]
    if b == 0 or h == 0 or s == 0:
        return out
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    block_d = max(16, _next_pow2(d))
    if block_m is None:
        block_m = min(64, max(16, _next_pow2(s)))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise InputError(f"{name} must be a power of two >= 16, got {blk}.")
    if mask is None:  # dummy pointer, never read
        mask_u8, mask_strides = q, (0, 0, 0, 0)
    else:
        mask_u8 = mask.view(torch.uint8)
        mask_strides = tuple(mask_u8.stride())
    plen = prefix_len if prefix_len is not None else q
    s_pb = prefix_len.stride(0) if prefix_len is not None else 0
    grid = ((s + block_m - 1) // block_m, b * h)
    _tree_attention_kernel[grid](
        q, k, v, out, mask_u8, plen,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mask_strides, s_pb,
        h, s, t, d, h // k.shape[1], scale * _LOG2E,
        MASK_MODE=mode, DOT_FP32=interpreter_mode() and q.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4 if block_d <= 64 else 8,
        enable_fp_fusion=True,  # FMA contraction is fine within attention's tolerance (and faster)
    )
    return out


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                   scale: float | None = None, block_m: int | None = None,
                   block_n: int | None = None) -> torch.Tensor:
    """Masked attention by the Triton kernel.

    q [B, H, S, D]; k, v [B, Hkv, T, D] (fp16/bf16/fp32, one dtype, D <= 256); mask bool [B, S, T] or
    [B, 1|H, S, T] (True = may attend) or None; scale defaults to 1/sqrt(D). Returns [B, H, S, D] in q's
    dtype, zeros for fully masked rows. `block_m` / `block_n` override the tile sizes (powers of two >= 16).
    Twin: `mmspec.attention.eager.eager_attention`.
    """
    _check_qkv(q, k, v)
    require_triton("the triton tree-attention kernel", q.device)
    b, h, s, _ = q.shape
    t = k.shape[2]
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise InputError("mask must be a bool tensor (True = may attend) or None.")
        if mask.device != q.device:
            raise InputError(f"mask is on {mask.device} but q is on {q.device}.")
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)  # [B, 1, S, T]
        if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h) \
                or tuple(mask.shape[2:]) != (s, t):
            raise InputError(
                f"mask has shape {list(mask.shape)}; expected [B, S, T] or [B, 1|H, S, T] = [{b}, {s}, {t}] "
                f"or [{b}, 1|{h}, {s}, {t}]."
            )
        mask = mask.expand(b, mask.shape[1], s, t)  # [B, 1|H, S, T]; stride 0 where broadcast
        if mask.shape[1] == 1:
            mask = mask.expand(b, h, s, t)  # head stride 0: broadcast over heads
    return _launch(q, k, v, _MODE_DENSE if mask is not None else _MODE_NONE, mask, None, scale,
                   block_m, block_n)


def structured_mask(prefix_len: torch.Tensor, tree_mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """The dense mask of the structured mode: prefix_len [B] int64, tree_mask [B, S, S] bool -> [B, S, T].

    Query i of row b sees key t iff t < prefix_len[b], or prefix_len[b] <= t < prefix_len[b] + S and
    tree_mask[b, i, t - prefix_len[b]]. Keys at or past `capacity` T do not exist.
    """
    b, s, _ = tree_mask.shape
    cols = torch.arange(capacity, device=tree_mask.device)  # [T]
    rel = cols - prefix_len.unsqueeze(-1)  # [B, T]
    in_prefix = rel < 0  # [B, T]
    in_tree = (rel >= 0) & (rel < s)  # [B, T]
    idx = rel.clamp(0, max(s - 1, 0)).unsqueeze(1).expand(b, s, capacity)  # [B, S, T]
    tree = tree_mask.gather(-1, idx) if s > 0 else torch.zeros(b, s, capacity, dtype=torch.bool,
                                                              device=tree_mask.device)  # [B, S, T]
    return in_prefix.unsqueeze(1) | (in_tree.unsqueeze(1) & tree)


def tree_attention_structured(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor,
                              tree_mask: torch.Tensor, *, scale: float | None = None,
                              block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention with a shared prefix and a small tree: the fast path of the kernel.

    q [B, H, S, D]; k, v [B, Hkv, T, D]; prefix_len [B] int64 (keys < prefix_len[b] are visible to every
    query of row b); tree_mask [B, S, S] bool (query i sees key prefix_len[b] + j iff tree_mask[b, i, j]).
    Keys from prefix_len[b] + S on are invisible and never read. Returns [B, H, S, D].
    Twin: `eager_attention(q, k, v, structured_mask(prefix_len, tree_mask, T)[:, None], scale)`.
    """
    _check_qkv(q, k, v)
    require_triton("the triton tree-attention kernel", q.device)
    b, _, s, _ = q.shape
    if not isinstance(prefix_len, torch.Tensor) or prefix_len.shape != (b,) or prefix_len.dtype != torch.int64:
        raise InputError(f"prefix_len must be an int64 tensor of shape [B] = [{b}].")
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool or tree_mask.shape != (b, s, s):
        raise InputError(f"tree_mask must be a bool tensor of shape [B, S, S] = [{b}, {s}, {s}].")
    if prefix_len.device != q.device or tree_mask.device != q.device:
        raise InputError("prefix_len and tree_mask must be on q's device.")
    tm = tree_mask.unsqueeze(1).expand(b, q.shape[1], s, s)  # [B, H, S, S], head stride 0
    return _launch(q, k, v, _MODE_STRUCTURED, tm, prefix_len, scale, block_m, block_n)
