"""Draft trees: the batched `DraftTree` type and EAGLE-2 dynamic tree expansion.

A tree has N nodes per row; node 0 is the root (the last committed token, which the target has not processed
yet), every other valid node is a drafted token whose parent has a smaller index. Rows of a batch hold
different trees padded to the same N (padding nodes are invalid, token -1, parent -1).

Derived layouts (all batched, [B, ...]):
- `attention_mask()`  [B, N, N] bool: node i sees node j iff j is i or an ancestor of i (the tree mask).
- `position_ids(L)`   [B, N]: L + depth, the positions the target uses for the tree nodes.
- `paths()`           [B, N, D+1]: for every node the root-to-node path of node indices, padded -1.
- `retrieve_indices()`[B, N, D+1]: the paths of leaves only (other rows -1), EAGLE's layout.

EAGLE-2 expansion (`expand_eagle2`): from the root, expand the top_k children of each frontier node, score
every node by its cumulative log-probability, keep the global top_k as the next frontier for `depth` levels,
then keep the best `total_tokens - 1` drafted nodes overall. Scores never increase along a path, so the kept
set is a connected tree; ties are broken towards earlier (shallower) nodes so that this holds exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mmspec.errors import InputError, check, check_positive_int


@dataclass
class DraftTree:
    """A batch of draft trees, node 0 the root. See the module docstring for the layouts."""

    tokens: torch.Tensor  # [B, N] int64, -1 for padding nodes
    parents: torch.Tensor  # [B, N] int64, -1 for the root and padding nodes
    depths: torch.Tensor  # [B, N] int64, 0 for the root (and padding)
    valid: torch.Tensor  # [B, N] bool
    max_depth: int  # static bound on depth (number of draft levels)
    max_children: int  # static bound on children per node
    child_probs: torch.Tensor | None = None  # [B, N, V] q at each node over its children, or None
    sampled: bool = False  # children sampled without replacement from child_probs (else deterministic top-k)
    scores: torch.Tensor | None = None  # [B, N] the drafter's cumulative log-prob of each node (root 0), or None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_chain(self) -> bool:
        """At most one child per node (a static fact): node i is then at depth i with parent i - 1 (invalid nodes
        after the valid ones), so the tree mask is causal and the accepted path is nodes 0..k, in place."""
        return self.max_children == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Check the structure (one host sync); raises InputError with what is wrong."""
        b, n = self.tokens.shape
        for name in ("parents", "depths", "valid"):
            t = getattr(self, name)
            if tuple(t.shape) != (b, n):
                raise InputError(f"DraftTree.{name} has shape {list(t.shape)}, expected [{b}, {n}] like tokens.")
        check(bool(self.valid[:, 0].all()), "DraftTree: node 0 (the root) must be valid in every row.")
        idx = torch.arange(n, device=self.tokens.device)
        drafted = self.valid & (idx > 0)
        check(
            bool(((self.parents < idx) & (self.parents >= 0))[drafted].all()),
            "DraftTree: every drafted node's parent must be a valid node with a smaller index.",
        )
        parent_depth = self.depths.gather(1, self.parents.clamp_min(0))
        check(bool((self.depths == parent_depth + 1)[drafted].all()), "DraftTree: depth must be parent depth + 1.")
        check(bool((self.depths <= self.max_depth).all()), "DraftTree: a node is deeper than max_depth.")
        if self.is_chain:
            valid = self.valid.long()
            check(bool((self.parents == idx - 1)[drafted].all()) and bool((valid.cummin(1).values == valid).all()),
                  "DraftTree: max_children=1 is a chain: node i's parent must be i - 1, valid nodes first.")
        if vocab_size is not None:
            toks = self.tokens[self.valid]
            check(bool(((toks >= 0) & (toks < vocab_size)).all()),
                  f"DraftTree: token ids must lie in [0, {vocab_size}).")
        if self.sampled and self.child_probs is None:
            raise InputError("DraftTree: sampled=True needs child_probs (the draft distribution q at each node).")

    # ---------------------------------------------------------------------------------- derived layouts
    def paths(self) -> torch.Tensor:
        """[B, N, D+1]: column d holds the depth-d ancestor of each node (the node itself at its depth)."""
        b, n = self.tokens.shape
        spare = self.max_depth + 1  # walkers past the root write into this extra column
        out = torch.full((b, n, spare + 1), -1, dtype=torch.long, device=self.tokens.device)
        node = torch.arange(n, device=self.tokens.device).expand(b, n)  # [B, N] walker
        for _ in range(self.max_depth + 1):  # static bound: walk up to the root
            d = torch.where(node >= 0, self.depths.gather(1, node.clamp_min(0)), spare)  # [B, N]
            out.scatter_(2, d.unsqueeze(-1), node.unsqueeze(-1))
            node = torch.where(node > 0, self.parents.gather(1, node.clamp_min(0)), torch.full_like(node, -1))
        return out[..., :spare].masked_fill(~self.valid.unsqueeze(-1), -1)

    def attention_mask(self) -> torch.Tensor:
        """[B, N, N] bool: query node i may attend to key node j iff j is i or an ancestor of i."""
        b, n = self.tokens.shape
        paths = self.paths()  # [B, N, D+1]
        mask = torch.zeros(b, n, n + 1, dtype=torch.bool, device=self.tokens.device)
        mask.scatter_(2, paths.masked_fill(paths < 0, n), True)  # -1 entries land in the spare column n
        return mask[..., :n] & self.valid.unsqueeze(-1)

    def position_ids(self, offset: torch.Tensor) -> torch.Tensor:
        """[B, N] = offset[B] + depth (the positions of the tree nodes in the sequence)."""
        return offset.unsqueeze(-1) + self.depths

    def is_leaf(self) -> torch.Tensor:
        """[B, N] bool: valid nodes with no valid child."""
        is_child = (self.valid & (self.parents >= 0)).long()  # [B, N]
        num_children = torch.zeros_like(is_child).scatter_add_(1, self.parents.clamp_min(0), is_child)
        return self.valid & (num_children == 0)

    def retrieve_indices(self) -> torch.Tensor:
        """[B, N, D+1]: root-to-leaf paths (EAGLE layout), one row per node, -1 for non-leaf rows."""
        return self.paths().masked_fill(~self.is_leaf().unsqueeze(-1), -1)


def chain_as_tree(draft_tokens: torch.Tensor, root_tokens: torch.Tensor,
                  draft_probs: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> DraftTree:
    """A chain of K drafts as a one-branch tree of K+1 nodes (`is_chain`); scores [B, K+1] the drafter's
    cumulative log-probs (root 0), if it has them."""
    b, k = draft_tokens.shape
    device = draft_tokens.device
    idx = torch.arange(k + 1, device=device)
    tokens = torch.cat([root_tokens.view(b, 1), draft_tokens], dim=1)  # [B, K+1]
    parents = (idx - 1).expand(b, k + 1).clone()  # [B, K+1]
    child_probs = None
    if draft_probs is not None:  # q at node i over its child = the chain's q_{i+1}
        child_probs = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, K+1, V]
    return DraftTree(tokens=tokens, parents=parents, depths=idx.expand(b, k + 1).clone(),
                     valid=torch.ones(b, k + 1, dtype=torch.bool, device=device), max_depth=k,
                     max_children=1, child_probs=child_probs, sampled=draft_probs is not None, scores=scores)


# ---------------------------------------------------------------------------------------- EAGLE-2 expansion
# score_children(frontier_tokens [B, F], frontier_ids [B, F], parent_ids [B, F], depth) -> log-probs [B, F, V]
# for the next token after each of the F frontier nodes, or a `Children` pair (log-probs [B, F, C], tokens
# [B, F, C], C >= top_k distinct tokens a node, the rest of the vocabulary below them: a drafter that scores a few
# candidates, as Token Recycling's table, never builds [B, F, V]). Ids index the candidate pool (root = 0, then
# every candidate in creation order), so a drafter can keep its own per-candidate cache and tree mask; parent_ids
# of the root is -1.
class Children(NamedTuple):
    """A scorer's few candidates a frontier node (see above)."""

    logp: torch.Tensor  # [B, F, C]
    tokens: torch.Tensor  # [B, F, C]


ScoreChildren = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], "torch.Tensor | Children"]


def pool_size(top_k: int, depth: int) -> int:
    """Nodes EAGLE-2 expansion creates (root included): 1 + top_k + (depth - 1) top_k^2."""
    return 1 + top_k + (depth - 1) * top_k * top_k


class TreeShape(NamedTuple):
    """A draft shape: top_k children per expanded node, `depth` drafted levels, `total` nodes with the root (a chain
    of d drafts: top_k 1, total d + 1; `PLAIN`: no drafts). A named tuple: a budget keys dicts by shapes."""

    top_k: int
    depth: int
    total: int

    def __str__(self) -> str:
        if self.total == 1:
            return "0"
        return f"chain{self.depth}" if self.top_k == 1 else f"tree{self.top_k}x{self.depth}n{self.total}"

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    def contains(self, other: TreeShape) -> bool:
        """Whether a step drafted with this shape shows what `other` would have accepted (EAGLE-2 keeps the nodes of
        highest score, so a smaller tree of the same top_k is the leading part of a larger one; a chain is the path
        of first children)."""
        if other.total == 1:
            return True
        if other.top_k == 1:
            return other.depth <= self.depth
        return other.top_k == self.top_k and other.depth <= self.depth and other.total <= self.total


PLAIN = TreeShape(0, 0, 1)  # no drafts: a plain one-token step
MAX_CHAIN_DEPTH = 16  # the deepest chain a budget may draft, whatever the drafter's own tree depth


def chain(depth: int) -> TreeShape:
    """The shape of a chain of `depth` drafts (`PLAIN` for 0)."""
    return PLAIN if depth == 0 else TreeShape(1, depth, depth + 1)


def max_chain_depth(full: TreeShape) -> int:
    """The deepest chain a drafter of shape `full` may draft: MAX_CHAIN_DEPTH within its node count (its own depth
    if that is deeper). A paper tree's depth says what fits a wide tree, not how far a greedy chain stays accepted:
    ViSpec's (depth 4, 30 nodes) capped at twice its depth drafted chains of 8 at 1.43x of vanilla where chains of
    16 ran at 1.60x (the world LLaVA at batch 1 on a 2-core CPU, 2026-11-25)."""
    return max(full.depth, min(MAX_CHAIN_DEPTH, full.total - 1))


class SteeredTree:
    """A tree drafter a draft budget can steer: its `full_shape` (set at construction) and `set_draft_size(shape)`;
    it drafts `top_k` children per frontier node, `depth` levels and `total` nodes with the root."""

    full_shape: TreeShape

    def set_draft_size(self, shape: TreeShape) -> None:
        """Draft `shape` from the next proposal on (a tree inside the full shape, or a chain up to
        `max_chain_depth`; either fits in the full shape's node count)."""
        full = self.full_shape
        deepest = max_chain_depth(full) if getattr(shape, "top_k", 0) == 1 else full.depth
        check(isinstance(shape, TreeShape) and 1 <= shape.depth <= deepest and 1 <= shape.top_k <= full.top_k
              and 2 <= shape.total <= min(full.total, pool_size(shape.top_k, shape.depth)),
              f"a draft shape must fit in the drafter's {full}, got {shape}.")
        self.top_k, self.depth, self.total = shape.top_k, shape.depth, shape.total


def levels_of_eagle_depth(code_depth: int) -> int:
    """Draft levels of a tree that EAGLE's or LANTERN's code configures with `depth=code_depth`: their `topK_genrate`
    expands the root, then `depth` more levels, so `depth=4` drafts 5 levels. mmspec's `depth` (here and in every
    tree drafter) counts draft levels, the longest run one step can accept: EAGLE-2's `depth=5` is 6 here,
    LANTERN's LlamaGen `depth=4` is 5, SpecVLM's `depth=7` is 8."""
    return code_depth + 1


def expand_eagle2(root_tokens: torch.Tensor, score_children: ScoreChildren, *, top_k: int = 10,
                  depth: int = 5, total_tokens: int = 60) -> DraftTree:
    """Build EAGLE-2 dynamic draft trees for a batch (deterministic top-k children), `depth` draft levels
    (`levels_of_eagle_depth`: EAGLE's code's depth + 1).

    `score_children` is called once per level with the current frontier (at most `top_k` nodes per row) and
    returns log-probabilities over the vocabulary for each frontier node's next token. Returns a DraftTree of
    exactly `total_tokens` nodes per row (root + total_tokens - 1 drafts), nodes ordered by depth, siblings by
    descending score.
    """
    check_positive_int("top_k", top_k)
    check_positive_int("depth", depth)
    check_positive_int("total_tokens", total_tokens, minimum=2)
    max_nodes = pool_size(top_k, depth)  # every candidate ever created
    check(total_tokens - 1 <= max_nodes - 1,
          f"total_tokens={total_tokens} exceeds what depth={depth}, top_k={top_k} can create ({max_nodes}).")
    if top_k == 1 and total_tokens == depth + 1:
        return expand_chain(root_tokens, score_children, depth)
    return expand_tree(root_tokens, score_children, top_k, depth, total_tokens)


def top_children(score_children: ScoreChildren, tokens: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor,
                 level: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, F, k] log-probs, [B, F, k] tokens) of the k best children of each frontier node [B, F] (pool ids `ids`,
    their parents' `parents`), from the scorer's [B, F, V] log-probs or its `Children` (shapes checked)."""
    out = score_children(tokens, ids, parents, level)
    logp, tok = (out.logp, out.tokens) if isinstance(out, Children) else (out, None)
    if (logp.dim() != 3 or logp.shape[:2] != ids.shape or logp.shape[-1] < k
            or (tok is not None and tok.shape != logp.shape)):
        raise InputError(f"score_children must return [B, F, V] log-probs or Children of [B, F, C >= {k}]; got "
                         f"{list(logp.shape)} for a frontier of shape {list(ids.shape)}.")
    best, at = logp.float().topk(k, dim=-1)  # [B, F, k]
    return best, (at if tok is None else tok.gather(-1, at))


def expand_chain(root_tokens: torch.Tensor, score_children: ScoreChildren, depth: int) -> DraftTree:
    """`expand_eagle2` at top_k 1 with every node kept: each level's best child of the one frontier node, the same
    tree (tokens, scores, the scorer's calls) without the candidate pool's sorting. Pool id of level d's node: d."""
    b = root_tokens.shape[0]
    device = root_tokens.device
    tokens, scores = [root_tokens.view(b, 1)], [torch.zeros(b, 1, dtype=torch.float32, device=device)]
    for d in range(1, depth + 1):
        ids = torch.full((b, 1), d - 1, dtype=torch.long, device=device)  # [B, 1]
        child_lp, child_tok = top_children(score_children, tokens[-1], ids, ids - 1, d - 1, 1)  # [B, 1, 1]
        tokens.append(child_tok[:, :, 0])  # [B, 1]
        scores.append(scores[-1] + child_lp[:, :, 0])  # [B, 1] cumulative log-prob
    nodes = torch.arange(depth + 1, device=device).expand(b, depth + 1)  # [B, D+1]
    return DraftTree(tokens=torch.cat(tokens, 1), parents=nodes - 1, depths=nodes,
                     valid=torch.ones(b, depth + 1, dtype=torch.bool, device=device), max_depth=depth,
                     max_children=1, scores=torch.cat(scores, 1))


def expand_tree(root_tokens: torch.Tensor, score_children: ScoreChildren, top_k: int, depth: int,
                total_tokens: int) -> DraftTree:
    """`expand_eagle2` through its candidate pool (any shape)."""
    b = root_tokens.shape[0]
    device = root_tokens.device

    # candidate pool, node 0 = root
    cand_tokens = [root_tokens.view(b, 1)]
    cand_parent = [torch.full((b, 1), -1, dtype=torch.long, device=device)]
    cand_score = [torch.zeros(b, 1, dtype=torch.float32, device=device)]
    cand_depth = [torch.zeros(b, 1, dtype=torch.long, device=device)]
    frontier = torch.zeros(b, 1, dtype=torch.long, device=device)  # [B, F] pool indices
    frontier_score = torch.zeros(b, 1, dtype=torch.float32, device=device)
    created = 1
    for d in range(1, depth + 1):
        tokens_pool = torch.cat(cand_tokens, 1)
        frontier_tokens = tokens_pool.gather(1, frontier)  # [B, F]
        frontier_parents = torch.cat(cand_parent, 1).gather(1, frontier)  # [B, F]
        child_lp, child_tok = top_children(score_children, frontier_tokens, frontier, frontier_parents, d - 1,
                                           top_k)  # [B, F, k]
        child_score = frontier_score.unsqueeze(-1) + child_lp  # [B, F, k] cumulative log-prob
        f = frontier.shape[1]
        cand_tokens.append(child_tok.reshape(b, f * top_k))
        cand_parent.append(frontier.unsqueeze(-1).expand(b, f, top_k).reshape(b, f * top_k))
        cand_score.append(child_score.reshape(b, f * top_k))
        cand_depth.append(torch.full((b, f * top_k), d, dtype=torch.long, device=device))
        # next frontier: global top_k of this level's children
        flat = child_score.reshape(b, f * top_k)
        keep = min(top_k, f * top_k)
        best_score, best = flat.topk(keep, dim=-1)  # [B, keep]
        frontier = created + best
        frontier_score = best_score
        created += f * top_k

    tokens_pool = torch.cat(cand_tokens, 1)  # [B, P]
    parent_pool = torch.cat(cand_parent, 1)
    score_pool = torch.cat(cand_score, 1)
    depth_pool = torch.cat(cand_depth, 1)
    # keep the best total_tokens - 1 drafted candidates; a stable tie-break by pool index (parents come first)
    drafted_score = score_pool[:, 1:]
    order = _stable_descending(drafted_score)[:, : total_tokens - 1] + 1  # [B, M] pool indices
    # reorder kept nodes by (depth, pool index) so parents precede children
    key = depth_pool.gather(1, order) * (created + 1) + order
    order = order.gather(1, key.argsort(dim=1))
    kept = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device), order], dim=1)  # [B, total]
    # map pool index -> new node index
    new_index = torch.full((b, created), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, kept, torch.arange(total_tokens, device=device).expand(b, total_tokens))
    parents = parent_pool.gather(1, kept)
    # every kept node's parent is kept too (scores are non-increasing along paths), so no parent maps to -1; not
    # checked here, as that would be a host sync in every proposal (tests check it on random scores)
    parents = torch.where(parents >= 0, new_index.gather(1, parents.clamp_min(0)), parents)
    return DraftTree(tokens=tokens_pool.gather(1, kept), parents=parents, depths=depth_pool.gather(1, kept),
                     valid=torch.ones(b, total_tokens, dtype=torch.bool, device=device), max_depth=depth,
                     max_children=top_k, scores=score_pool.gather(1, kept))


def _stable_descending(scores: torch.Tensor) -> torch.Tensor:
    """argsort descending with ties broken by lower index (stable)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices
