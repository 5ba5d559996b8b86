"""The attention backend registry: every usable backend matches `eager` on causal, ragged and tree masks."""

from __future__ import annotations

import pytest
import torch

import mmspec.attention as attention
from mmspec.attention import (
    attend,
    available_backends,
    default_backend,
    get_backend,
    register_backend,
    registered_backends,
    set_default_backend,
)
from mmspec.errors import InputError

S = 7  # query positions (the 7-node tree of conftest.TREE_PARENTS)
T = 23  # cache capacity
D = 16


def _mask(masks, kind: str, batch: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "causal":
        return masks.causal(batch, S, T)
    if kind == "ragged":  # different valid lengths per row; row 1 has two padded queries
        lengths = [T, 11, 9][:batch]
        return masks.ragged(lengths, S, T, valid_queries=[S, S - 2, S][:batch])
    if kind == "tree":
        return masks.tree([4, 12, 0][:batch], masks.tree_parents, T)
    raise AssertionError(kind)


def _inputs(batch: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, S, D, generator=g).to(dtype)  # [B, H, S, D]
    k = torch.randn(batch, kv_heads, T, D, generator=g).to(dtype)  # [B, Hkv, T, D]
    v = torch.randn(batch, kv_heads, T, D, generator=g).to(dtype)  # [B, Hkv, T, D]
    return q, k, v


def _other_backends() -> list:
    """Every backend but the reference; the Triton one carries the `triton` marker."""
    return ["sdpa", "xformers", pytest.param("triton", marks=pytest.mark.triton)]


@pytest.fixture
def restore_default():
    before = default_backend()
    yield
    set_default_backend(before)


@pytest.mark.parametrize("backend", _other_backends())
@pytest.mark.parametrize("kind", ["none", "causal", "ragged", "tree"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_backend_matches_eager_fp32(backend: str, kind: str, heads: int, kv_heads: int, masks) -> None:
    assert backend in registered_backends()
    if backend == "triton":
        pytest.importorskip("triton")
    if backend not in available_backends("cpu"):
        pytest.skip(f"{backend} cannot run on CPU here")
    q, k, v = _inputs(3, heads, kv_heads, torch.float32)
    mask = _mask(masks, kind, 3)
    ref = attend(q, k, v, mask, backend="eager")  # [B, H, S, D]
    out = attend(q, k, v, mask, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    if kind == "ragged":  # padded queries of row 1 give exact zeros
        assert torch.equal(out[1, :, S - 2:], torch.zeros_like(out[1, :, S - 2:]))


@pytest.mark.parametrize("kind", ["causal", "ragged", "tree"])
def test_sdpa_matches_eager_bf16(kind: str, masks) -> None:
    q, k, v = _inputs(3, 4, 2, torch.bfloat16, seed=1)
    mask = _mask(masks, kind, 3)
    ref = attend(q, k, v, mask, backend="eager")
    out = attend(q, k, v, mask, backend="sdpa")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


def _skip_unless_usable(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    if backend not in available_backends("cpu"):
        pytest.skip(f"{backend} cannot run on CPU here")


@pytest.mark.parametrize("backend", ["eager", *_other_backends()])
@pytest.mark.parametrize("layout", ["3d", "4d_1", "4d_h", "batch_1"])
def test_mask_layouts_broadcast(layout: str, backend: str, masks) -> None:
    _skip_unless_usable(backend)
    q, k, v = _inputs(2, 4, 2, torch.float32)
    base = _mask(masks, "tree", 2)  # [B, S, T]
    per_head = base[:, None].expand(2, 4, S, T).clone()  # [B, H, S, T]
    per_head[:, 1, :, :3] = False  # heads may differ
    by_layout = {
        "3d": base,
        "4d_1": base[:, None],
        "4d_h": per_head,
        "batch_1": base[:1].expand(1, S, T),  # one mask for the whole batch
    }
    mask = by_layout[layout]
    full = {"4d_h": per_head, "batch_1": base[:1, None].expand(2, 1, S, T)}.get(layout, base[:, None])
    ref = attention.get_backend("eager")(q, k, v, full, D ** -0.5)  # [B, H, S, D]
    torch.testing.assert_close(attend(q, k, v, mask, backend=backend), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", *_other_backends()])
def test_fully_masked_rows_are_zero(backend: str) -> None:
    _skip_unless_usable(backend)
    q, k, v = _inputs(2, 4, 2, torch.float32)
    mask = torch.zeros(2, S, T, dtype=torch.bool)
    mask[0, 0, :5] = True  # one query sees keys, all others see nothing
    out = attend(q, k, v, mask, backend=backend)
    assert not torch.isnan(out).any()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :, 1:], torch.zeros_like(out[0, :, 1:]))
    assert out[0, :, 0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_sdpa_without_the_masked_row_guard_is_the_same(dtype: torch.dtype, kv_heads: int, monkeypatch) -> None:
    """Where this torch's CPU SDPA zeroes fully masked rows itself, `sdpa` skips its guard (five operations per
    layer): the outputs are bit-identical to the guarded call's, fully masked rows zero."""
    import mmspec.attention.sdpa as sdpa

    q, k, v = _inputs(2, 4, kv_heads, dtype)
    mask = torch.rand(2, 1, S, T, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[1, 0, 2] = False  # a query that sees nothing
    with torch.no_grad():
        skipped = sdpa.sdpa_attention(q, k, v, mask, D ** -0.5)
        monkeypatch.setattr(sdpa, "zeroes_fully_masked_rows", lambda dtype: False)
        guarded = sdpa.sdpa_attention(q, k, v, mask, D ** -0.5)
    assert torch.equal(skipped, guarded)
    assert torch.equal(skipped[1, :, 2], torch.zeros_like(skipped[1, :, 2]))


def test_the_additive_mask_is_made_once_per_mask() -> None:
    """Every layer of a forward passes the same bool mask: its additive form is made once and reused, and made
    again for another mask, a view with other strides, a mask changed in place or another dtype."""
    from mmspec.attention.sdpa import additive_mask

    mask = torch.rand(2, S, T, generator=torch.Generator().manual_seed(4)) < 0.5
    first = additive_mask(mask.unsqueeze(1), torch.float32)  # [B, 1, S, T]
    assert torch.equal(first, torch.where(mask.unsqueeze(1), 0.0, float("-inf")))
    assert additive_mask(mask.unsqueeze(1), torch.float32) is first  # another view of the same mask: reused
    assert additive_mask(mask.clone().unsqueeze(1), torch.float32) is not first
    assert additive_mask(mask.unsqueeze(1), torch.bfloat16).dtype == torch.bfloat16
    again = additive_mask(mask.unsqueeze(1), torch.float32)
    mask[0, 0, 0] = not bool(mask[0, 0, 0])  # changed in place
    changed = additive_mask(mask.unsqueeze(1), torch.float32)
    assert changed is not again and torch.equal(changed, torch.where(mask.unsqueeze(1), 0.0, float("-inf")))


def test_eager_fully_masked_rows_have_finite_gradients(masks) -> None:
    q, k, v = _inputs(1, 2, 2, torch.float32)
    q.requires_grad_(True)
    mask = masks.causal(1, S, T)
    mask[0, 2] = False
    attend(q, k, v, mask, backend="eager").sum().backward()
    assert torch.isfinite(q.grad).all()


def test_default_scale_and_explicit_scale() -> None:
    q, k, v = _inputs(1, 2, 2, torch.float32)
    out_default = attend(q, k, v, backend="eager")
    out_explicit = attend(q, k, v, backend="eager", scale=D ** -0.5)
    torch.testing.assert_close(out_default, out_explicit)
    out_other = attend(q, k, v, backend="sdpa", scale=0.5)
    torch.testing.assert_close(out_other, attend(q, k, v, backend="eager", scale=0.5), atol=2e-5, rtol=1e-5)


def test_default_backend_is_sdpa_and_settable(restore_default, masks) -> None:
    assert default_backend() == "sdpa"
    calls = []

    def spy(q, k, v, mask, scale):
        calls.append((mask.shape if mask is not None else None, scale))
        return attention.get_backend("eager")(q, k, v, mask, scale)

    register_backend("spy", spy)
    set_default_backend("spy")
    q, k, v = _inputs(2, 4, 2, torch.float32)
    attend(q, k, v, _mask(masks, "causal", 2))
    assert calls == [((2, 1, S, T), D ** -0.5)]  # the mask reaches the backend as [B, 1, S, T]
    assert "spy" in available_backends()
    assert get_backend("spy") is spy


def test_unknown_backend_lists_known_ones(restore_default) -> None:
    q, k, v = _inputs(1, 2, 2, torch.float32)
    with pytest.raises(InputError, match="known backends: .*eager.*sdpa"):
        attend(q, k, v, backend="flash9")
    with pytest.raises(InputError, match="unknown attention backend"):
        get_backend("nope")
    with pytest.raises(InputError, match="unknown attention backend"):
        set_default_backend("nope")


def test_xformers_on_cpu_is_a_clear_error() -> None:
    q, k, v = _inputs(1, 2, 2, torch.float32)
    with pytest.raises(InputError, match="xformers backend needs CUDA tensors and `pip install mmspec\\[xformers\\]`"):
        attend(q, k, v, backend="xformers")


@pytest.mark.triton
def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _inputs(1, 2, 2, torch.float32)
    pytest.importorskip("triton")
    assert "triton" not in available_backends("cpu")
    with pytest.raises(InputError, match="triton"):
        attend(q, k, v, backend="triton")


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("q3d", "q must be 4-D"),
        ("heads", "multiple of the kv heads"),
        ("dim", "head dim"),
        ("kv_len", "k and v must have the same shape"),
        ("batch", "batch"),
        ("mask_shape", "mask has shape"),
        ("mask_dtype", "mask must be bool"),
        ("dtype", "one dtype"),
        ("int_q", "floating-point"),
    ],
)
def test_bad_inputs_raise_input_error(case: str, pattern: str, masks) -> None:
    q, k, v = _inputs(2, 4, 2, torch.float32)
    mask = masks.causal(2, S, T)
    if case == "q3d":
        q = q[0]
    elif case == "heads":
        k, v = k[:, :1].expand(2, 3, T, D), v[:, :1].expand(2, 3, T, D)
    elif case == "dim":
        k, v = k[..., :8], v[..., :8]
    elif case == "kv_len":
        v = v[:, :, :-1]
    elif case == "batch":
        k, v = k[:1], v[:1]
    elif case == "mask_shape":
        mask = mask[:, :, :-1]
    elif case == "mask_dtype":
        mask = mask.float()
    elif case == "dtype":
        k = k.double()
    elif case == "int_q":
        q = q.long()
    with pytest.raises(InputError, match=pattern):
        attend(q, k, v, mask, backend="eager")


def test_empty_key_axis_gives_zeros() -> None:
    q, _, _ = _inputs(1, 2, 2, torch.float32)
    k = torch.zeros(1, 2, 0, D)
    mask = torch.zeros(1, S, 0, dtype=torch.bool)
    for name in ("eager", "sdpa"):
        out = attend(q, k, k, mask, backend=name)
        assert torch.equal(out, torch.zeros_like(q)), name


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_attend_compiles_fullgraph(backend: str, masks) -> None:
    """No host synchronisation and no graph break: `attend` compiles with fullgraph=True (graph capture only)."""
    q, k, v = _inputs(2, 4, 2, torch.float32)
    mask = _mask(masks, "ragged", 2)

    def run(q, k, v, mask):
        return attend(q, k, v, mask, backend=backend)

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, mask), run(q, k, v, mask))
