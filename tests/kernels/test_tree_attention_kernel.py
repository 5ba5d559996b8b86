"""The Triton tree/ragged attention kernel against its twin (the eager backend), under TRITON_INTERPRET=1.

Small shapes, tiles of 16 so that several query and key tiles (and their ragged edges) are exercised.
"""

from __future__ import annotations

import pytest
import torch

from mmspec.attention.eager import eager_attention
from mmspec.errors import InputError

pytest.importorskip("triton")
from mmspec.kernels.tree_attention import (  # noqa: E402
    structured_mask,
    tree_attention,
    tree_attention_structured,
)

pytestmark = pytest.mark.triton


def _qkv(b: int, h: int, hkv: int, s: int, t: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g).to(dtype)  # [B, H, S, D]
    k = torch.randn(b, hkv, t, d, generator=g).to(dtype)  # [B, Hkv, T, D]
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)  # [B, Hkv, T, D]
    return q, k, v


def _ref(q, k, v, mask, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    m4 = None if mask is None else (mask[:, None] if mask.dim() == 3 else mask)
    return eager_attention(q, k, v, m4, scale)


@pytest.mark.parametrize(
    "b,h,hkv,s,t,d",
    [
        (2, 2, 2, 5, 37, 16),  # S < tile, T not a multiple of the key tile
        (1, 4, 1, 20, 40, 8),  # MQA, S spans two query tiles, D < 16 (padded)
        (2, 4, 2, 7, 33, 24),  # GQA, D not a power of two (padded to 32)
    ],
)
@pytest.mark.parametrize("kind", ["random", "ragged", "tree"])
def test_dense_mask_matches_twin(b, h, hkv, s, t, d, kind, masks) -> None:
    q, k, v = _qkv(b, h, hkv, s, t, d)
    if kind == "random":
        mask = torch.rand(b, s, t, generator=torch.Generator().manual_seed(1)) < 0.4
        mask[0, min(1, s - 1)] = False  # a fully masked query row
    elif kind == "ragged":
        lengths = [t - 3 * i for i in range(b)]
        mask = masks.ragged(lengths, s, t, valid_queries=[s - i for i in range(b)])
    else:
        parents = [-1] + [torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i)).item()
                          for i in range(1, s)]
        mask = masks.tree([t - s - 2 * i for i in range(b)], parents, t)
    out = tree_attention(q, k, v, mask, block_m=16, block_n=16)  # [B, H, S, D]
    torch.testing.assert_close(out, _ref(q, k, v, mask), atol=2e-5, rtol=1e-5)


def test_no_mask_per_head_mask_and_scale() -> None:
    q, k, v = _qkv(1, 4, 2, 6, 21, 16, seed=3)
    torch.testing.assert_close(tree_attention(q, k, v, block_n=16), _ref(q, k, v, None), atol=2e-5, rtol=1e-5)
    mask = torch.rand(1, 4, 6, 21, generator=torch.Generator().manual_seed(4)) < 0.5  # [B, H, S, T]
    out = tree_attention(q, k, v, mask, scale=0.3, block_n=16)
    torch.testing.assert_close(out, _ref(q, k, v, mask, 0.3), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_non_contiguous_inputs(dtype: torch.dtype, masks) -> None:
    # a model's projections are [B, S, H, D]; the kernel reads them through strides, without a copy
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 4, 16, generator=g).to(dtype).transpose(1, 2)  # [B, H, S, D] view
    k = torch.randn(2, 29, 2, 16, generator=g).to(dtype).transpose(1, 2)  # [B, Hkv, T, D] view
    v = torch.randn(2, 29, 2, 16, generator=g).to(dtype).transpose(1, 2)
    mask = masks.ragged([29, 17], 6, 29)
    out = tree_attention(q, k, v, mask, block_n=16)
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), _ref(q, k, v, mask).float(), atol=3e-2, rtol=2e-2)


def test_fully_masked_rows_and_empty_cache() -> None:
    q, k, v = _qkv(1, 2, 2, 4, 10, 16)
    mask = torch.zeros(1, 4, 10, dtype=torch.bool)
    out = tree_attention(q, k, v, mask)
    assert torch.equal(out, torch.zeros_like(out))
    empty = torch.zeros(1, 2, 0, 16)
    out = tree_attention(q, empty, empty, torch.zeros(1, 4, 0, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("hkv", [1, 2])
def test_structured_mode_matches_twin(hkv: int, masks) -> None:
    s, t = 7, 40
    q, k, v = _qkv(3, 2, hkv, s, t, 16, seed=7)
    prefix_len = torch.tensor([0, 13, 35])  # the last row's tree runs past T: those keys do not exist
    anc = masks.ancestors(masks.tree_parents)  # [S, S]
    tree = torch.stack([anc, anc, anc.tril() & (torch.rand(s, s) < 0.7) | torch.eye(s, dtype=torch.bool)])
    dense = structured_mask(prefix_len, tree, t)  # [B, S, T]
    assert torch.equal(dense[:2], masks.tree([0, 13], masks.tree_parents, t))
    out = tree_attention_structured(q, k, v, prefix_len, tree, block_n=16)
    torch.testing.assert_close(out, _ref(q, k, v, dense), atol=2e-5, rtol=1e-5)


def test_bad_inputs() -> None:
    q, k, v = _qkv(1, 2, 2, 4, 10, 16)
    with pytest.raises(InputError, match="mask has shape"):
        tree_attention(q, k, v, torch.ones(1, 4, 9, dtype=torch.bool))
    with pytest.raises(InputError, match="bool"):
        tree_attention(q, k, v, torch.ones(1, 4, 10))
    with pytest.raises(InputError, match="multiple of Hkv"):
        tree_attention(q, k[:, :1].expand(1, 3, 10, 16), v[:, :1].expand(1, 3, 10, 16))
    with pytest.raises(InputError, match="head dim"):
        big = torch.zeros(1, 1, 2, 512)
        tree_attention(big, big, big)
    with pytest.raises(InputError, match="dtype"):
        tree_attention(q.double(), k.double(), v.double())
    with pytest.raises(InputError, match="block_n"):
        tree_attention(q, k, v, block_n=24)
    with pytest.raises(InputError, match="prefix_len"):
        tree_attention_structured(q, k, v, torch.tensor([1.0]), torch.ones(1, 4, 4, dtype=torch.bool))
    with pytest.raises(InputError, match="tree_mask"):
        tree_attention_structured(q, k, v, torch.tensor([1]), torch.ones(1, 4, 3, dtype=torch.bool))


@pytest.mark.interpreter_only
def test_cpu_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(1, 2, 2, 4, 10, 16)
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        tree_attention(q, k, v)



@pytest.mark.parametrize("variant", ["bf16-mode0", "bf16-mode1", "bf16-mode2", "fp32-mode1"])
def test_kernel_compiles_for_a_gpu(variant: str, gpu_compilation) -> None:
    """AOT compilation for sm_90 down to a cubin (no GPU needed): every mask mode, 16-bit and fp32 inputs."""
    result = gpu_compilation[f"tree-{variant}"]
    assert result["ok"], result["error"]
