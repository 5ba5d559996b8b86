"""Drafter-invariant verification (`coupled`): the token emitted at every index is vanilla's sample there.

With position-keyed noise (`mmspec.noise`) vanilla decoding emits at token index t the exponential race of the
target's p_t under E_t, the "sample" noise of t: argmax_v p_t(v) / E_t(v) (a Gumbel-max sample of p_t). This rule
emits the same: the target's token at every drafted index is that race, a draft is accepted when it equals it (the
greedy rule's walk, with the race in place of the argmax), and the first mismatch emits the race's token. So the
output IS vanilla's sample for the same keys, token for token, whatever was drafted: it does not depend on the
drafter, the draft sizes a budget picks, the batch the row is in or the machine's load, and it is lossless because
vanilla's is (each E_t is independent of every token before index t).

Drafts are accepted with probability P(draft == race(p_t, E_t)). For drafts chosen without looking at E_t (an
EAGLE tree's deterministic top-k children, Jacobi's initialised tokens) that is p_t(x), as under the lossless rule
(a tree's siblings together: the sum of their p, as its deterministic walk). Sampled drafts are coupled: drafters
draw them with the same E_t (`KeyedNoise.draft_exponentials` under a rule that `couples_drafts`), so x = race(q_t,
E_t) and the acceptance is P(race(q, E) == race(p, E)) >= (1 - TV) / (1 + TV) (Gumbel coupling; Daliri et al. 2025,
MC-SJD), against the lossless rule's 1 - TV: measured per family in docs/verify.md.

Glossary: B rows, K drafts, N tree nodes, V vocabulary; a tree node at depth d predicts the token at index
positions + d.
"""

from __future__ import annotations

import torch

from mmspec.tree import DraftTree
from mmspec.verify.base import AcceptanceRule, Randomness, VerifyResult, register_rule
from mmspec.verify.chain import verify_chain_greedy
from mmspec.verify.tree_walk import verify_tree_greedy


def sample_exponentials(rand: Randomness, levels: int) -> torch.Tensor:
    """[B, L, V] the "sample" noise of token indices positions + 0 .. L - 1 (given exponentials, without keys, serve
    every index: [B, 1, V])."""
    if rand.exponentials is not None:
        return rand.exponentials.unsqueeze(1)
    index = rand.positions.unsqueeze(-1) + torch.arange(levels, device=rand.positions.device)  # [B, L]
    return rand.noise.exponentials(index, "sample", rand.vocab)


@register_rule
class CoupledRule(AcceptanceRule):
    """Accept a draft iff it is the target's own sample at its index (see the module docstring)."""

    name = "coupled"
    lossless = True
    couples_drafts = True
    plain_step_samples_p = True  # a plain step's token is the race at its index: the lossless rule's, the same
    chain_form_on_chain_trees = True

    def verify_chain(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, rand: Randomness,
                     num_draft: torch.Tensor) -> VerifyResult:
        scores = target_probs.double() / sample_exponentials(rand, draft_tokens.shape[1] + 1)  # [B, K+1, V] p_j: g + j
        out, acc, flags = verify_chain_greedy(draft_tokens, scores, num_draft)  # (argmax of p / E: the race)
        return VerifyResult(out, acc, flags, num_draft)

    def verify_tree(self, tree: DraftTree, target_probs: torch.Tensor, rand: Randomness) -> VerifyResult:
        levels = sample_exponentials(rand, tree.max_depth + 1)  # [B, D+1, V]
        if levels.shape[1] > 1:  # node u predicts index g + depth(u)
            levels = levels.gather(1, tree.depths.unsqueeze(-1).expand(-1, -1, levels.shape[-1]))  # [B, N, V]
        return verify_tree_greedy(tree, target_probs.double() / levels)
