"""Acceptance rules: given drafts and the target's distributions, decide what each row keeps.

    from mmspec.verify import ChainDraft, accept
    result = accept("lossless", ChainDraft(tokens, probs=q), p, generator=gen)
    result.output_tokens   # [B, K+1] accepted drafts, then the recovered/bonus token, -1 padded
    result.num_accepted    # [B]

Rules (`available_rules()`): `lossless` (chain and tree), `coupled` (chain and tree: the target's own sample at every
index, vanilla's for the call's keys), `greedy` (chain and tree), `lantern` (chain and tree; delta or lambda form),
`gsd` (chain), `capped` (chain: Lumina-mGPT 2.0's SJD code, q capped in the residual). Each is a named mode with
parameters; `get_rule(name, **params)`.
`accept` validates its inputs once and draws the randomness from the user's generator(s); the rules
themselves are pure tensor functions (they compile with `torch.compile(fullgraph=True)`).
"""

from __future__ import annotations

import torch

from mmspec.errors import InputError, check, check_distribution, check_shape
from mmspec.noise import KeyedNoise
from mmspec.sampling import Generators
from mmspec.tree import DraftTree
from mmspec.verify import capped, coupled, gsd, lantern, lossless  # noqa: F401  (register the rules)
from mmspec.verify.base import (
    AcceptanceRule,
    ChainDraft,
    Draft,
    Randomness,
    VerifyResult,
    available_rules,
    get_rule,
    register_rule,
    rule_class,
    rule_keeps_distribution,
)
from mmspec.verify.capped import CappedRule
from mmspec.verify.coupled import CoupledRule
from mmspec.verify.gsd import GSDRule
from mmspec.verify.lantern import LanternRule, build_neighbour_table, load_or_build_neighbour_table
from mmspec.verify.lossless import GreedyRule, LosslessRule

__all__ = [
    "AcceptanceRule", "CappedRule", "ChainDraft", "CoupledRule", "Draft", "DraftTree", "GSDRule", "GreedyRule",
    "LanternRule", "LosslessRule", "Randomness", "VerifyResult", "accept", "available_rules", "build_neighbour_table",
    "get_rule", "load_or_build_neighbour_table", "register_rule", "rule_class", "rule_keeps_distribution",
    "validate_draft",
]


def validate_draft(rule: AcceptanceRule, draft: Draft, target_probs: torch.Tensor) -> None:
    """Check shapes, vocabularies, token ranges and values; raise InputError naming what is wrong."""
    check(isinstance(target_probs, torch.Tensor) and target_probs.dim() == 3,
          f"target_probs must be a [B, positions, V] tensor, got "
          f"{list(target_probs.shape) if isinstance(target_probs, torch.Tensor) else type(target_probs).__name__}.")
    b, _, v = target_probs.shape
    if isinstance(draft, ChainDraft):
        check(rule.supports_chain, f"acceptance rule {rule.name!r} does not verify chains.")
        check_shape("draft tokens", draft.tokens, [b, None], "[B, K] (batch, draft length)")
        k = draft.tokens.shape[1]
        check_shape("target_probs", target_probs, [b, k + 1, v], "[B, K+1, V]: p at every draft position plus "
                    "the bonus position")
        check(draft.tokens.dtype == torch.long, f"draft tokens must be int64, got {draft.tokens.dtype}.")
        num_draft = draft.resolved_num_draft()
        check_shape("num_draft", num_draft, [b], "[B]")
        check(bool(((num_draft >= 0) & (num_draft <= k)).all()), f"num_draft must lie in [0, {k}].")
        drafted = torch.arange(k, device=draft.tokens.device) < num_draft.unsqueeze(-1)
        toks = draft.tokens[drafted]
        check(bool(((toks >= 0) & (toks < v)).all()),
              f"draft tokens must lie in [0, {v}) (the target's vocabulary) at drafted positions.")
        if draft.probs is not None:
            if draft.probs.dim() == 3 and draft.probs.shape[-1] != v:
                raise InputError(f"draft vocabulary size {draft.probs.shape[-1]} does not match the target's {v}; "
                                 "the drafter and the target must share one tokenizer / codebook.")
            check_shape("draft probs (q)", draft.probs, [b, k, v], "[B, K, V]")
            check_distribution("draft probs (q)", draft.probs[drafted])
    elif isinstance(draft, DraftTree):
        check(rule.supports_tree, f"acceptance rule {rule.name!r} does not verify trees; use a chain draft.")
        check_shape("target_probs", target_probs, [draft.batch_size, draft.num_nodes, v], "[B, N, V] (tree nodes)")
        draft.validate(v)
        if draft.child_probs is not None:
            if draft.child_probs.shape[-1] != v:
                raise InputError(f"draft vocabulary size {draft.child_probs.shape[-1]} does not match the "
                                 f"target's {v}.")
            check_shape("tree child_probs (q)", draft.child_probs, [b, draft.num_nodes, v], "[B, N, V]")
    else:
        raise InputError(f"draft must be a ChainDraft or a DraftTree, got {type(draft).__name__}.")
    rule.check_inputs(target_probs)


PLAIN_STEP_RULE = LosslessRule()  # what a step without drafts runs under rules that say `plain_step_samples_p`


def accept(rule: str | AcceptanceRule, draft: Draft, target_probs: torch.Tensor,
           generator: Generators = None, *, validate: bool = True, noise: KeyedNoise | None = None,
           positions: torch.Tensor | None = None, **rule_params) -> VerifyResult:
    """Verify `draft` against the target distributions with `rule` (a name or a rule object).

    target_probs: [B, K+1, V] for a ChainDraft (p at each draft position and the bonus position), or
    [B, N, V] for a DraftTree (p for the token after each node). Randomness is position-keyed (`mmspec.noise`):
    `noise` the call's keyed noise and `positions` [B] the token index of the first token this call decides (the
    loop passes both; None: 0), else keys drawn now from `generator` (one torch.Generator, a list with one per row,
    or None). `validate=False` skips the checks (they synchronise with the device).
    """
    rule = get_rule(rule, **rule_params)
    if validate:
        validate_draft(rule, draft, target_probs)
    b, _, v = target_probs.shape
    rand = None
    if rule.uses_randomness:
        if noise is None:
            noise = KeyedNoise.from_generators(generator, b, target_probs.device)
        if positions is None:
            positions = torch.zeros(b, dtype=torch.long, device=target_probs.device)
        rand = Randomness.keyed(noise, positions, draft, v)
    plain = isinstance(draft, ChainDraft) and draft.tokens.shape[1] == 0
    if plain and rule.uses_randomness and rule.plain_step_samples_p:
        rule = PLAIN_STEP_RULE  # no drafts: the token is sampled from p, as the lossless rule does
    if isinstance(draft, ChainDraft):
        return rule.verify_chain(draft.tokens, target_probs, draft.probs, rand, draft.resolved_num_draft())
    if draft.is_chain and not draft.sampled and rule.chain_form_on_chain_trees:
        return verify_chain_tree(rule, draft, target_probs, rand)
    return rule.verify_tree(draft, target_probs, rand)


def verify_chain_tree(rule: AcceptanceRule, tree: DraftTree, target_probs: torch.Tensor,
                      rand: Randomness | None) -> VerifyResult:
    """A one-branch tree of deterministic drafts (`tree.is_chain`) through the rule's chain form, which gives its tree
    form's tokens from the same numbers for rules that say `chain_form_on_chain_trees` (fewer operations: no paths
    or sibling tables). The result has the tree's layout: `accepted_nodes` [B, D+1] = 0..num_accepted, -1 after."""
    drafted = tree.valid[:, 1:]  # [B, D] a prefix of each row's nodes
    drafts = tree.tokens[:, 1:].masked_fill(~drafted, -1)  # [B, D]
    chain_rand = None if rand is None else rand.from_second()  # node i -> draft i-1
    result = rule.verify_chain(drafts, target_probs, None, chain_rand, drafted.sum(-1))
    nodes = torch.arange(tree.num_nodes, device=drafts.device)  # [D+1]
    result.accepted_nodes = torch.where(nodes <= result.num_accepted.unsqueeze(-1), nodes, -1)  # [B, D+1]
    return result
