"""The `triton` attention backend: the tree/ragged-mask flash-attention kernel of `mmspec.kernels`.

Runs on CUDA tensors, or on CPU tensors in Triton's interpreter (`TRITON_INTERPRET=1`, for tests). The
kernel reads the bool mask tile by tile and maps query heads to kv heads by index (no GQA copy). Its
PyTorch twin is the `eager` backend.
"""

from __future__ import annotations

import torch

from mmspec.errors import InputError
from mmspec.kernels import can_run_triton, require_triton


def triton_usable(device: torch.device) -> bool:
    """Triton importable, and CUDA tensors (or interpreter mode)."""
    return can_run_triton(device)


def triton_unusable_reason(device: torch.device) -> str:
    """Why the backend cannot run on `device` (no triton, CPU without the interpreter, interpreter set late)."""
    try:
        require_triton("The triton backend", device)
    except InputError as err:
        return str(err)
    return ""


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """q [B, H, S, D], k and v [B, Hkv, T, D], mask [B, 1|H, S, T] bool or None -> [B, H, S, D]."""
    from mmspec.kernels.tree_attention import tree_attention

    return tree_attention(q, k, v, mask, scale=scale)
