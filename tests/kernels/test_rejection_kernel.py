"""The fused chain rejection-sampling kernel is identical, token for token, to its twin
`mmspec.verify.chain.verify_chain_lossless` (under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from mmspec.errors import InputError
from mmspec.verify.chain import verify_chain_lossless

pytest.importorskip("triton")
from mmspec.kernels.rejection import rejection_sample_chain  # noqa: E402

pytestmark = pytest.mark.triton

B, K = 4, 3


def _case(v: int, with_q: bool, seed: int, sparse: bool = False):
    """Random draft/target distributions that agree often enough to accept some drafts and reject others."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, K + 1, v, generator=g) * 2  # [B, K+1, V]
    p_logits = base + 0.5 * torch.randn(B, K + 1, v, generator=g)
    q_logits = base[:, :K] + 0.5 * torch.randn(B, K, v, generator=g)  # [B, K, V]
    if sparse:  # top-k style filtering: many exact zeros in p and q
        p_logits = p_logits.masked_fill(torch.rand(B, K + 1, v, generator=g) < 0.6, float("-inf"))
        q_logits = q_logits.masked_fill(torch.rand(B, K, v, generator=g) < 0.6, float("-inf"))
        p_logits[..., 0] = 0.0
        q_logits[..., 0] = 0.0  # keep every row non-empty
    p = torch.softmax(p_logits, -1)  # [B, K+1, V] float32
    q = torch.softmax(q_logits, -1)  # [B, K, V]
    if with_q:
        x = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(B, K)  # drafts sampled from q
    else:
        x = base[:, :K].argmax(-1)  # greedy-ish one-hot drafts
    num_draft = torch.tensor([0, 1, 2, 3])[torch.randperm(B, generator=g)]  # ragged, includes 0 and K
    x = torch.where(torch.arange(K) < num_draft[:, None], x, torch.full_like(x, -1))
    u = torch.rand(B, K, generator=g, dtype=torch.float64)  # [B, K]
    e = (-torch.log1p(-torch.rand(B, v, generator=g, dtype=torch.float64))).clamp_min(1e-300)  # [B, V]
    return x, p, (q if with_q else None), u, e, num_draft


def _assert_identical(args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = rejection_sample_chain(*args, **kwargs)
    want = verify_chain_lossless(*args)
    names = ("output_tokens", "num_accepted", "accepted_flags")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}:\nkernel {a}\ntwin   {b}"
    return got


@pytest.mark.parametrize("v", [37, 130])
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("block_v", [None, 16])  # one vocabulary tile, or several
def test_random_inputs_identical_to_twin(v: int, with_q: bool, block_v: int | None) -> None:
    accepted, rejected_seen = 0, 0
    for seed in range(6):
        args = _case(v, with_q, seed, sparse=seed % 2 == 1)
        _, num_acc, _ = _assert_identical(args, block_v=block_v)
        accepted += int(num_acc.sum())
        rejected_seen += int((num_acc < args[-1]).sum())
    assert accepted > 0 and rejected_seen > 0  # both paths (recovered and bonus tokens) were exercised


def test_empty_residual_falls_back_to_p() -> None:
    v = 37
    x, p, q, u, e, _ = _case(v, True, seed=11)
    num_draft = torch.full((B,), K)
    x = torch.randint(0, v, (B, K), generator=torch.Generator().manual_seed(0))
    # position 1 of every row: p == q exactly and the drafted token has probability 0 under both, so the
    # draft is rejected (U * 0 < 0 is false) and max(p - q, 0) is all zero
    q[:, 1] = p[:, 1]
    p[torch.arange(B), 1, x[:, 1]] = 0.0
    q[:, 1] = p[:, 1]
    u[:, 0] = 0.0  # accept position 0 whenever p_0(x_0) > 0
    p[torch.arange(B), 0, x[:, 0]] = 0.5
    out, num_acc, _ = _assert_identical((x, p, q, u, e, num_draft))
    assert torch.equal(num_acc, torch.ones(B, dtype=torch.int64))
    assert torch.equal(out[:, 1], (p[:, 1].double() / e).argmax(-1))  # the fallback is the race on p


def test_empty_residual_one_hot() -> None:
    v = 37
    x, p, _, u, e, _ = _case(v, False, seed=12)
    num_draft = torch.full((B,), K)
    x = x.clamp_min(0)
    # all of p_0's mass on the drafted token, but U >= p(x): rejected, and p without x is all zero
    p[:, 0] = 0.0
    p[torch.arange(B), 0, x[:, 0]] = 0.5
    u[:, 0] = 0.75
    out, num_acc, _ = _assert_identical((x, p, None, u, e, num_draft))
    assert torch.equal(num_acc, torch.zeros(B, dtype=torch.int64))
    assert torch.equal(out[:, 0], x[:, 0])


@pytest.mark.parametrize("with_q", [False, True])
def test_ties_go_to_the_lowest_index_across_tiles(with_q: bool) -> None:
    v = 40
    x = torch.tensor([[5, 7, 9], [5, 7, 9], [2, 3, 4], [1, 1, 1]])  # [B, K]
    p = torch.zeros(B, K + 1, v)
    p[:, :, [5, 20, 33]] = 1 / 3  # equal weights in three different tiles of 16
    p[:, :, 2] = 0.0
    q = torch.zeros(B, K, v)
    q[:, :, 5] = 1.0  # the draft puts everything on token 5
    u = torch.full((B, K), 0.5, dtype=torch.float64)
    u[0] = 0.9  # row 0: reject at 0 (0.9 * q(5) >= p(5) for q given; 0.9 >= 1/3 one-hot)
    e = torch.ones(B, v, dtype=torch.float64)  # every race is a tie between equal weights
    num_draft = torch.tensor([3, 3, 3, 0])
    args = (x, p, q if with_q else None, u, e, num_draft)
    for block_v in (16, 64):
        out, _, _ = _assert_identical(args, block_v=block_v)
    assert out[0, 0] == 20  # residual: token 5 zeroed (one-hot) or p - q < 0 there; 20 ties 33 and wins
    assert out[3, 0] == 5  # bonus token with no drafts: race on p, 5 ties 20 and 33 and wins


def test_acceptance_boundary_is_bit_exact() -> None:
    v = 37
    x, p, q, u, e, num_draft = _case(v, True, seed=21)
    x = x.clamp_min(0)
    num_draft = torch.full((B,), K)
    rows = torch.arange(B)[:, None]
    p_x = p[rows, torch.arange(K), x].double()  # [B, K]
    q_x = q[rows, torch.arange(K), x].double()
    # U exactly at p/q (rounded), and its neighbours: the float64 comparison decides, in both the same way
    ratio = (p_x / q_x).clamp(max=1 - 1e-16)
    for shift in (-1, 0, 1):
        u_b = torch.nextafter(ratio, torch.full_like(ratio, 2.0 * shift)) if shift else ratio
        _assert_identical((x, p, q, u_b.clamp(0, 1 - 1e-16), e, num_draft))


def test_no_drafts_and_strided_inputs() -> None:
    v = 37
    x, p, q, u, e, _ = _case(v, True, seed=31)
    # K = 0: every row emits one bonus token sampled from p_0
    _assert_identical((x[:, :0], p[:, :1], q[:, :0], u[:, :0], e, torch.zeros(B, dtype=torch.int64)))
    # strided views (a slice of a bigger vocabulary, a transposed layout) are read through their strides
    big = torch.softmax(torch.randn(B, K + 1, v + 5), -1)[..., :v]  # [B, K+1, V] non-contiguous
    p_t = p.transpose(0, 1).contiguous().transpose(0, 1)  # [B, K+1, V] with permuted strides
    num_draft = torch.tensor([3, 2, 1, 3])
    x = torch.where(torch.arange(K) < num_draft[:, None], x.clamp_min(0), torch.full_like(x, -1))
    _assert_identical((x, big, q, u, e, num_draft), block_v=16)
    _assert_identical((x, p_t, None, u, e, num_draft))


def test_empty_batch() -> None:
    out, num_acc, flags = rejection_sample_chain(
        torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K + 1, 5), None,
        torch.zeros(0, K, dtype=torch.float64), torch.ones(0, 5, dtype=torch.float64),
        torch.zeros(0, dtype=torch.int64),
    )
    assert out.shape == (0, K + 1) and num_acc.shape == (0,) and flags.shape == (0, K)


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("p_dtype", "target_probs must be torch.float32"),
        ("u_dtype", "uniforms must be torch.float64"),
        ("p_shape", "target_probs has shape"),
        ("q_shape", "draft_probs has shape"),
        ("e_shape", "exponentials has shape"),
        ("n_shape", "num_draft has shape"),
        ("x_dtype", "draft_tokens must be torch.int64"),
        ("block", "block_v"),
    ],
)
def test_bad_inputs(case: str, pattern: str) -> None:
    x, p, q, u, e, n = _case(37, True, seed=0)
    kwargs = {}
    if case == "p_dtype":
        p = p.double()
    elif case == "u_dtype":
        u = u.float()
    elif case == "p_shape":
        p = p[:, :K]
    elif case == "q_shape":
        q = q[..., :-1]
    elif case == "e_shape":
        e = e[:, :-1]
    elif case == "n_shape":
        n = n[:-1]
    elif case == "x_dtype":
        x = x.int()
    elif case == "block":
        kwargs["block_v"] = 24
    with pytest.raises(InputError, match=pattern):
        rejection_sample_chain(x, p, q, u, e, n, **kwargs)


@pytest.mark.interpreter_only
def test_cpu_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InputError, match="CUDA"):
        rejection_sample_chain(*_case(37, True, seed=0))



@pytest.mark.parametrize("with_q", [False, True])
def test_kernel_compiles_for_a_gpu_and_keeps_float_ops_exact(with_q: bool, gpu_compilation) -> None:
    """AOT compilation for sm_90 (no GPU needed); the float ops are the twin's: rounded, no ftz, no fma."""
    result = gpu_compilation[f"rejection-q{int(with_q)}"]
    assert result["ok"], result["error"]
    ptx = result["ptx"]
    assert "div.rn.f64" in ptx and "fma" not in ptx and ".ftz" not in ptx


def test_lossless_rule_can_use_the_kernel(kernel_device: str):
    from mmspec.verify import ChainDraft, accept

    gen = torch.Generator().manual_seed(0)
    b, k, v = 5, 3, 29
    p = torch.softmax(torch.randn(b, k + 1, v, generator=gen), -1)
    q = torch.softmax(torch.randn(b, k, v, generator=gen), -1)
    x = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k)
    want = accept("lossless", ChainDraft(x, q), p, torch.Generator().manual_seed(1))
    x, q, p = x.to(kernel_device), q.to(kernel_device), p.to(kernel_device)  # the rule calls the kernel itself
    got = accept("lossless", ChainDraft(x, q), p, torch.Generator().manual_seed(1), kernel="triton")
    assert torch.equal(got.output_tokens.cpu(), want.output_tokens)
