"""`mmspec selfcheck`: check an installation end to end in well under a minute on a CPU.

It runs the real core on the toy target and reports each check with what it measured:
greedy speculative decoding (draft model, EAGLE-2 tree, random drafts) reproduces greedy vanilla decoding token
for token; lossless sampling keeps the target distribution (total-variation distance of a batched run);
every registered attention backend usable here agrees with the eager reference; Triton kernels agree with
their PyTorch twins when Triton can run (CUDA, or TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from mmspec.errors import MMSpecError


class Skipped(Exception):
    """A check that cannot run on this machine (reported as 'skip', not as a pass)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="device to run the checks on (cpu or cuda)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy models and prompts")


def _greedy_equivalence(device: str, seed: int) -> str:
    from mmspec.lm import DraftModelDrafter, LMTarget, NoDrafter, TreeModelDrafter
    from mmspec.loop import generate
    from mmspec.sampling import SamplingParams
    from mmspec.testing.drafters import RandomDrafter
    from mmspec.testing.toy import toy_model

    greedy = SamplingParams(temperature=0)
    target = toy_model(seed).to(device)
    small = toy_model(seed + 1, dim=16).to(device)
    prompt = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(seed)).to(device)

    def run(drafter):
        return generate(LMTarget(target, greedy, 32), drafter, "greedy", prompt, batch_size=4, max_new_tokens=32,
                        device=device)

    vanilla = run(NoDrafter())
    lines = []
    for name, drafter in (("draft model", DraftModelDrafter(small, 4, greedy)),
                          ("EAGLE-2 tree", TreeModelDrafter(target, top_k=3, depth=4, total_tokens=12)),
                          ("random drafts", RandomDrafter(16, 4))):
        out = run(drafter)
        if not torch.equal(out.tokens, vanilla.tokens):
            raise MMSpecError(f"greedy speculative decoding with {name} differs from vanilla decoding")
        s = out.stats
        lines.append(f"{name}: identical; {s.num_target_forwards} target forwards vs "
                     f"{vanilla.stats.num_target_forwards}, mean acceptance length {s.mean_acceptance_length:.2f}")
    return "; ".join(lines)


def _lossless_distribution(device: str, seed: int) -> str:
    from mmspec.testing.distributions import empirical_distribution, tv_distance, tv_tolerance
    from mmspec.verify import ChainDraft, accept

    gen = torch.Generator().manual_seed(seed)
    n, k, v = 100_000, 3, 10
    p_rows = torch.softmax(torch.randn(k + 1, v, generator=gen) * 1.5, -1)
    q_rows = torch.softmax(torch.randn(k, v, generator=gen) * 1.5, -1)
    x = torch.multinomial(q_rows, n, replacement=True, generator=gen).T
    res = accept("lossless", ChainDraft(x.to(device), q_rows.expand(n, k, v).to(device)),
                 p_rows.expand(n, k + 1, v).to(device), torch.Generator(device).manual_seed(seed))
    tv = tv_distance(empirical_distribution(res.output_tokens[:, 0].cpu(), v), p_rows[0])
    bound = tv_tolerance(v, n)
    if tv >= bound:
        raise MMSpecError(f"lossless chain rule: TV to target {tv:.4f} >= bound {bound:.4f}")
    return f"first-token TV to target {tv:.4f} (bound {bound:.4f}, {n} samples)"


def _attention_backends(device: str, seed: int) -> str:
    from mmspec.attention import attend, available_backends

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 5, 16, generator=gen).to(device)
    k = torch.randn(2, 2, 9, 16, generator=gen).to(device)
    v = torch.randn(2, 2, 9, 16, generator=gen).to(device)
    mask = (torch.rand(2, 5, 9, generator=gen) < 0.7).to(device)
    mask[..., 0] = True
    want = attend(q, k, v, mask, backend="eager")
    checked = []
    for name in available_backends(torch.device(device)):
        err = float((attend(q, k, v, mask, backend=name) - want).abs().max())
        if err > 1e-4:
            raise MMSpecError(f"attention backend {name!r} differs from eager by {err:.2e}")
        checked.append(f"{name} ({err:.1e})")
    return "max |diff| vs eager: " + ", ".join(checked)


def _kernels(device: str, seed: int) -> str:
    from mmspec.kernels import can_run_triton

    if not can_run_triton(torch.device(device)):
        raise Skipped("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 (the PyTorch twins are in use)")
    from mmspec.kernels.rejection import rejection_sample_chain
    from mmspec.verify import Randomness
    from mmspec.verify.chain import verify_chain_lossless

    gen = torch.Generator().manual_seed(seed)
    b, k, v = 4, 3, 37
    p = torch.softmax(torch.randn(b, k + 1, v, generator=gen), -1).to(device)
    q = torch.softmax(torch.randn(b, k, v, generator=gen), -1).to(device)
    x = torch.randint(0, v, (b, k), generator=gen).to(device)
    rand = Randomness.draw(b, k, v, gen)
    nd = torch.tensor([3, 2, 1, 0], device=device)
    args = (x, p, q, rand.uniforms.to(device), rand.exponentials.to(device), nd)
    if not all(torch.equal(a, b_) for a, b_ in zip(rejection_sample_chain(*args), verify_chain_lossless(*args))):
        raise MMSpecError("Triton rejection-sampling kernel differs from its PyTorch twin")
    return "rejection-sampling kernel identical to its PyTorch twin"


CHECKS: list[tuple[str, Callable[[str, int], str]]] = [
    ("greedy speculative == greedy vanilla", _greedy_equivalence),
    ("lossless sampling keeps the target distribution", _lossless_distribution),
    ("attention backends agree", _attention_backends),
    ("Triton kernels agree with their twins", _kernels),
]


def run(args: argparse.Namespace) -> int:
    import mmspec

    print(f"mmspec {mmspec.__version__} selfcheck on {args.device} (torch {torch.__version__})")
    failures = 0
    for title, check in CHECKS:
        start = time.perf_counter()
        try:
            detail = check(args.device, args.seed)
            status = "ok"
        except Skipped as why:
            detail, status = str(why), "skip"
        except MMSpecError as err:
            detail, status = str(err), "FAIL"
            failures += 1
        print(f"[{status:>4}] {title} ({time.perf_counter() - start:.1f}s): {detail}")
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0
