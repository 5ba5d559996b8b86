"""Fused chain rejection sampling (lossless speculative sampling) as one Triton kernel, vLLM-style.

One program per batch row does the whole verification of that row's chain of K drafted tokens:

1. accept draft x_i iff `U_i * q_i(x_i) < p_i(x_i)` in float64 (q_i(x_i) = 1 for one-hot drafts) and
   i < num_draft; num_accepted = the length of the leading run of accepted drafts (vectorised over K);
2. at j = num_accepted, one pass over the vocabulary in blocks of BLOCK_V runs two exponential races at once,
   `argmax(w / E)` for the residual w = max(p_j - q_j, 0) (one-hot drafts: p_j with x_j zeroed) and
   `argmax(p_j / E)`; the recovered token is the first, or the second when w is all zero (the empty-residual
   fallback); when every draft was accepted (j == num_draft) w = p_j and the result is the bonus token;
3. writes the accepted drafts, the recovered/bonus token and -1 padding, num_accepted and the flags.

Ties in the race go to the lowest index, within a block (`tl.argmax`) and across blocks (a later block
replaces the running best only when strictly larger), exactly as `torch.argmax`.

PyTorch twin: `mmspec.verify.chain.verify_chain_lossless`; the results are identical, token for token
(the tests check it under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.errors import InputError
from mmspec.kernels import lazy_jit, require_triton

# `triton.language`, put here by `lazy_jit` on the first launch; importing this module does not import triton
tl: Any = None

__all__ = ["rejection_sample_chain"]

_MAX_BLOCK_V = 1024


@lazy_jit
def _rejection_chain_kernel(
    draft_ptr, s_db, s_dk,  # draft tokens [B, K] int64
    p_ptr, s_pb, s_pk, s_pv,  # target probs [B, K+1, V] float32
    q_ptr, s_qb, s_qk, s_qv,  # draft probs [B, K, V] float32 (unused when HAS_Q is False)
    u_ptr, s_ub, s_uk,  # uniforms [B, K] float64
    e_ptr, s_eb, s_ev,  # exponentials [B, V] float64
    n_ptr, s_nb,  # num_draft [B] int64
    out_ptr, acc_ptr, flag_ptr,  # outputs, contiguous: [B, K+1] int64, [B] int64, [B, K] uint8
    K, V,
    HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + row * s_nb)  # drafts in this row

    # ---- 1. acceptance, vectorised over the K positions
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K], BLOCK_K >= K + 1
    in_k = offs_k < K
    x = tl.load(draft_ptr + row * s_db + offs_k * s_dk, mask=in_k, other=-1)  # [BLOCK_K] int64
    x_ok = in_k & (x >= 0) & (x < V)
    x_safe = tl.where(x_ok, x, 0)
    p_x = tl.load(p_ptr + row * s_pb + offs_k * s_pk + x_safe * s_pv, mask=x_ok, other=0.0)  # [BLOCK_K] f32
    u = tl.load(u_ptr + row * s_ub + offs_k * s_uk, mask=in_k, other=1.0)  # [BLOCK_K] f64
    if HAS_Q:
        q_x = tl.load(q_ptr + row * s_qb + offs_k * s_qk + x_safe * s_qv, mask=x_ok, other=0.0)  # [BLOCK_K]
        accept = u * q_x.to(tl.float64) < p_x.to(tl.float64)
    else:
        accept = u < p_x.to(tl.float64)
    accept = accept & in_k & (offs_k < n)  # [BLOCK_K]
    # leading run of accepted = index of the first non-accepted position (K if none)
    j = tl.min(tl.where(accept | (offs_k >= K), K, offs_k), 0).to(tl.int64)  # num_accepted, scalar
    rejected = j < n  # a draft was rejected at j: recover from the residual; else bonus from p_j

    # ---- 2. the race at position j over the vocabulary
    jd = tl.minimum(j, K - 1)  # the twin reads the draft at min(j, K-1); only used when rejected
    rej_ok = rejected & (jd >= 0)  # jd >= 0 always holds for valid num_draft; guards memory otherwise
    x_j = tl.load(draft_ptr + row * s_db + jd * s_dk, mask=rej_ok, other=-1)
    x_j = tl.maximum(x_j, 0)  # the twin's one-hot residual zeroes index clamp_min(x_j, 0)
    q_lim = tl.where(rej_ok, V, 0)  # q_j is read only when a draft was rejected
    p_row = p_ptr + row * s_pb + j * s_pk
    q_row = q_ptr + row * s_qb + jd * s_qk
    e_row = e_ptr + row * s_eb
    best_w = tl.full([], -1.0, tl.float64)  # scores are >= 0, so -1 loses to any real entry
    best_w_idx = tl.zeros([], tl.int64)
    best_p = tl.full([], -1.0, tl.float64)
    best_p_idx = tl.zeros([], tl.int64)
    any_w = tl.zeros([], tl.int32)  # whether some residual weight is non-zero
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        in_v = offs_v < V
        p = tl.load(p_row + offs_v * s_pv, mask=in_v, other=0.0)  # [BLOCK_V] f32
        e = tl.load(e_row + offs_v * s_ev, mask=in_v, other=1.0)  # [BLOCK_V] f64
        if HAS_Q:
            q = tl.load(q_row + offs_v * s_qv, mask=offs_v < q_lim, other=0.0)  # [BLOCK_V] f32
            resid = tl.maximum(p - q, 0.0)  # f32, as the twin's (p - q).clamp_min(0)
        else:
            resid = tl.where(offs_v == x_j, 0.0, p)
        w = tl.where(rejected, resid, p)  # [BLOCK_V] f32
        any_w = any_w | tl.max(((w != 0.0) & in_v).to(tl.int32), 0)
        score_w = tl.where(in_v, w.to(tl.float64) / e, -1.0)  # [BLOCK_V] f64
        score_p = tl.where(in_v, p.to(tl.float64) / e, -1.0)
        blk_w, blk_w_idx = tl.max(score_w, 0, return_indices=True, return_indices_tie_break_left=True)
        blk_p, blk_p_idx = tl.max(score_p, 0, return_indices=True, return_indices_tie_break_left=True)
        take_w = blk_w > best_w  # strict: on ties the earlier block keeps the win
        best_w_idx = tl.where(take_w, v0 + blk_w_idx.to(tl.int64), best_w_idx)
        best_w = tl.where(take_w, blk_w, best_w)
        take_p = blk_p > best_p
        best_p_idx = tl.where(take_p, v0 + blk_p_idx.to(tl.int64), best_p_idx)
        best_p = tl.where(take_p, blk_p, best_p)
    token = tl.where(any_w != 0, best_w_idx, best_p_idx)  # empty residual: fall back to p_j

    # ---- 3. outputs
    out = tl.where(offs_k < j, x, tl.where(offs_k == j, token, -1))  # [BLOCK_K]
    tl.store(out_ptr + row * (K + 1) + offs_k, out, mask=offs_k < K + 1)
    tl.store(flag_ptr + row * K + offs_k, (offs_k < j).to(tl.uint8), mask=in_k)
    tl.store(acc_ptr + row, j)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, layout: str,
           device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}.")
    if tuple(t.shape) != shape:
        raise InputError(f"{name} has shape {list(t.shape)}, expected {list(shape)} {layout}.")
    if t.dtype != dtype:
        raise InputError(f"{name} must be {dtype}, got {t.dtype}; convert it (e.g. `.to({dtype})`).")
    if device is not None and t.device != device:
        raise InputError(f"{name} is on {t.device}, expected {device} (the device of draft_tokens).")


def rejection_sample_chain(
    draft_tokens: torch.Tensor,  # [B, K] int64, -1 past num_draft
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, or None for one-hot drafts
    uniforms: torch.Tensor,  # [B, K] float64 in [0, 1)
    exponentials: torch.Tensor,  # [B, V] float64, Exp(1), > 0
    num_draft: torch.Tensor,  # [B] int64 in [0, K]
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless chain verification in one kernel launch; same arguments and results as the twin
    `mmspec.verify.chain.verify_chain_lossless`.

    Returns (output_tokens [B, K+1] int64 padded with -1, num_accepted [B] int64, accepted_flags [B, K]
    bool). Shapes and dtypes are checked (no host synchronisation); values are not: drafted tokens must lie
    in [0, V) and num_draft in [0, K], as for the twin. `block_v` overrides the vocabulary tile (a power of
    two >= 16; default next_pow2(V) clamped to [16, 1024]).
    """
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise InputError("draft_tokens must be a 2-D int64 tensor [B, K] (padded with -1).")
    b, k = draft_tokens.shape
    dev = draft_tokens.device
    _check("draft_tokens", draft_tokens, (b, k), torch.int64, "[B, K]", None)
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise InputError("target_probs must be a 3-D float32 tensor [B, K+1, V].")
    v = target_probs.shape[-1]
    if v < 1:
        raise InputError("target_probs has an empty vocabulary axis (V = 0).")
    _check("target_probs", target_probs, (b, k + 1, v), torch.float32, "[B, K+1, V]", dev)
    if draft_probs is not None:
        _check("draft_probs", draft_probs, (b, k, v), torch.float32, "[B, K, V] (or None for one-hot)", dev)
    _check("uniforms", uniforms, (b, k), torch.float64, "[B, K]", dev)
    _check("exponentials", exponentials, (b, v), torch.float64, "[B, V]", dev)
    _check("num_draft", num_draft, (b,), torch.int64, "[B]", dev)
    if block_v is None:
        block_v = max(16, min(_next_pow2(v), _MAX_BLOCK_V))
    if block_v < 16 or block_v & (block_v - 1):
        raise InputError(f"block_v must be a power of two >= 16, got {block_v}.")
    require_triton("the triton rejection-sampling kernel", dev)

    output = torch.empty((b, k + 1), dtype=torch.int64, device=dev)  # [B, K+1]
    num_accepted = torch.empty((b,), dtype=torch.int64, device=dev)  # [B]
    flags = torch.empty((b, k), dtype=torch.uint8, device=dev)  # [B, K]
    if b > 0:
        q = draft_probs if draft_probs is not None else target_probs  # dummy pointer when one-hot
        _rejection_chain_kernel[(b,)](
            draft_tokens, *draft_tokens.stride(),
            target_probs, *target_probs.stride(),
            q, *q.stride(),
            uniforms, *uniforms.stride(),
            exponentials, *exponentials.stride(),
            num_draft, *num_draft.stride(),
            output, num_accepted, flags,
            k, v,
            HAS_Q=draft_probs is not None,
            BLOCK_K=max(2, _next_pow2(k + 1)),
            BLOCK_V=block_v,
            num_warps=4 if block_v <= 512 else 8,
            enable_fp_fusion=False,  # no FMA contraction: the float ops stay the twin's, one by one
        )
    return output, num_accepted, flags.view(torch.bool)
