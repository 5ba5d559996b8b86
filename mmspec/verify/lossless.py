"""The exact rules: lossless speculative sampling (chain and tree) and greedy verification.

`lossless` keeps the target distribution exactly: chain drafts with a draft distribution q or one-hot drafts
(docs/verify.md, `lossless`), trees with deterministic top-k children or children sampled without replacement
(same section). `greedy` accepts drafts equal to the target's argmax, for temperature 0.
"""

from __future__ import annotations

import torch

from mmspec.errors import check, check_finite
from mmspec.tree import DraftTree
from mmspec.verify.base import AcceptanceRule, Randomness, VerifyResult, register_rule
from mmspec.verify.chain import count_leading, lossless_accept, verify_chain_greedy, verify_chain_lossless
from mmspec.verify.tree_walk import normalise, pick, verify_tree_deterministic, verify_tree_greedy, walk_tree


def lossless_node_accept(p_work: torch.Tensor, q_work: torch.Tensor | None, x: torch.Tensor,
                         u: torch.Tensor) -> torch.Tensor:
    """Accept child x iff u < p(x) / q(x) (q = 1 for deterministic children), without dividing."""
    p_x = pick(p_work, x).double()
    if q_work is None:
        return u < p_x
    return u * pick(q_work, x).double() < p_x


def lossless_node_reject(p_work: torch.Tensor, q_work: torch.Tensor | None,
                         x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Deterministic child: remove x from p. Sampled child: p <- norm(max(p - q, 0)), q <- q without x."""
    if q_work is None:
        return normalise(p_work.scatter(-1, x.unsqueeze(-1), 0.0), p_work), None
    p_next = normalise((p_work - q_work).clamp_min(0), p_work)
    q_next = normalise(q_work.scatter(-1, x.unsqueeze(-1), 0.0), torch.zeros_like(q_work))
    return p_next, q_next


@register_rule
class LosslessRule(AcceptanceRule):
    """Speculative sampling that preserves the target distribution exactly."""

    name = "lossless"
    plain_step_samples_p = True
    lossless = True
    chain_form_on_chain_trees = True

    def __init__(self, kernel: str = "torch") -> None:
        """kernel: "torch" (the PyTorch implementation) or "triton" (the fused rejection-sampling kernel of
        `mmspec.kernels.rejection`, token-identical; needs CUDA or TRITON_INTERPRET=1). The default stays
        "torch" until GPU benchmarks show the kernel is faster."""
        check(kernel in ("torch", "triton"), f"kernel must be 'torch' or 'triton', got {kernel!r}.")
        self.kernel = kernel

    def config(self) -> dict:
        return {"name": self.name, "kernel": self.kernel}

    def verify_chain(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, rand: Randomness,
                     num_draft: torch.Tensor) -> VerifyResult:
        if self.kernel == "triton":
            from mmspec.kernels.rejection import rejection_sample_chain

            exponentials = rand.exponentials  # (the kernel samples the emitted token itself: its index first)
            if exponentials is None:
                drafted = torch.arange(draft_tokens.shape[1], device=num_draft.device) < num_draft.unsqueeze(-1)
                accepted = lossless_accept(draft_tokens, target_probs, draft_probs, rand.uniforms) & drafted
                exponentials = rand.exponentials_at(count_leading(accepted))
            out, acc, flags = rejection_sample_chain(draft_tokens, target_probs, draft_probs, rand.uniforms,
                                                     exponentials, num_draft)
        else:
            out, acc, flags = verify_chain_lossless(draft_tokens, target_probs, draft_probs, rand.uniforms,
                                                    rand.exponentials_at, num_draft)
        return VerifyResult(out, acc, flags, num_draft)

    def verify_tree(self, tree: DraftTree, target_probs: torch.Tensor, rand: Randomness) -> VerifyResult:
        """Deterministic children: the one-pass form (`verify_tree_deterministic`); sampled children: the walk
        (SpecInfer / RSD recursive rejection)."""
        if not tree.sampled:
            return verify_tree_deterministic(tree, target_probs, rand)
        return walk_tree(tree, target_probs, rand, lossless_node_accept, lossless_node_reject)


@register_rule
class GreedyRule(AcceptanceRule):
    """Temperature 0: accept drafts equal to the target argmax; emit the argmax at the first mismatch."""

    name = "greedy"
    lossless = True
    uses_randomness = False
    chain_form_on_chain_trees = True

    def check_inputs(self, target_probs: torch.Tensor) -> None:
        check_finite("target_probs", target_probs)  # logits are fine: only the argmax matters

    def verify_chain(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, rand: Randomness | None,
                     num_draft: torch.Tensor) -> VerifyResult:
        out, acc, flags = verify_chain_greedy(draft_tokens, target_probs, num_draft)
        return VerifyResult(out, acc, flags, num_draft)

    def verify_tree(self, tree: DraftTree, target_probs: torch.Tensor,
                    rand: Randomness | None) -> VerifyResult:
        return verify_tree_greedy(tree, target_probs)
