"""`capped`: the acceptance of Lumina-mGPT 2.0's SJD code (`generate_examples/sjds.py`): speculative sampling with
the draft probability capped in the residual.

A draft x is accepted with probability min(1, p(x) / q(x)), as the lossless rule; a rejected row samples from
norm(max(p - min(q, cap), 0)) where the lossless rule uses norm(max(p - q, 0)) (an empty residual falls back to p,
in both). The law of the emitted token is min(p, q) + (1 - sum min(p, q)) * norm(max(p - min(q, cap), 0)): the
target's p exactly unless some token has both p(v) > cap and q(v) > cap (its residual mass is then p(v) - cap, not
0), i.e. when the target and its draft are nearly sure of the same token. cap >= 1 is the lossless rule. The code's
default 0.99 is the rule's; SJD's paper (and mmspec's `lossless`) has no cap. Chains only (Jacobi windows).

Glossary: B rows, K drafts, V vocabulary.
"""

from __future__ import annotations

import torch

from mmspec.errors import check
from mmspec.verify.base import AcceptanceRule, Randomness, VerifyResult, register_rule
from mmspec.verify.chain import lossless_accept, verify_chain


@register_rule
class CappedRule(AcceptanceRule):
    """Speculative sampling with q capped at `cap` in the residual (see the module docstring)."""

    name = "capped"
    supports_tree = False
    plain_step_samples_p = True  # a step without drafts samples p, as the lossless rule

    def __init__(self, cap: float = 0.99) -> None:
        check(isinstance(cap, (int, float)) and 0 < cap, f"cap must be a number > 0, got {cap!r}.")
        self.cap = float(cap)
        self.lossless = self.keeps_distribution(cap)  # (cap >= 1: the lossless rule; the budget's default follows)

    @classmethod
    def keeps_distribution(cls, cap: float = 0.99, **_) -> bool:
        return float(cap) >= 1.0

    def config(self) -> dict:
        return {"name": self.name, "cap": self.cap}

    def residual(self, p_j: torch.Tensor, q_j: torch.Tensor | None, x_j: torch.Tensor) -> torch.Tensor:
        """max(p - min(q, cap), 0) [B, V]; a one-hot draft (q None) is q = 1 at x capped: p - cap there."""
        if q_j is None:
            q_j = torch.zeros_like(p_j).scatter(-1, x_j.clamp_min(0).unsqueeze(-1), 1.0)
        return (p_j - q_j.clamp_max(self.cap)).clamp_min(0)

    def verify_chain(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, rand: Randomness,
                     num_draft: torch.Tensor) -> VerifyResult:
        out, acc, flags = verify_chain(draft_tokens, target_probs, draft_probs, rand.uniforms, rand.exponentials_at,
                                       num_draft, lossless_accept, self.residual)
        return VerifyResult(out, acc, flags, num_draft)
