"""Tree verification: the accepted path through each row's draft tree, children tried in sibling order.

Below each node its children are tried in node order (for EAGLE-2 trees that is descending draft score). A rule
supplies two pure functions on the working distributions at a parent, elementwise over leading axes:

    accept_fn(p_work [..., V], q_work [..., V] | None, x [...], u [...] float64) -> [...] bool
    reject_fn(p_work, q_work, x) -> (p_work', q_work')      # the distributions for the next sibling

With lossless rules this is SpecInfer / RSD multi-candidate verification: deterministic children are accepted
with probability p(c) and removed from p on rejection; sampled children with min(1, p(c)/q(c)), then
p <- norm(max(p - q, 0)) and q <- q without c. When every child is rejected, the recovered token is sampled from
the final p_work; at a leaf (or at max depth) the bonus token is sampled from the node's p.

`walk_tree` runs that walk on one of two schedules with identical results (tested): `walk_by_depth` follows each
row from the root, leaving its loops once no row needs them (the CPU default: a host sync costs nothing there and
only the accepted path is computed); `walk_by_rank` tries every node's child of sibling rank s at once,
max_children static steps with no host sync (the GPU and torch.compile default). Relaxed rules (GSD, LANTERN) and
sampled children use it. `verify_tree_deterministic` does the lossless rule's deterministic-children case in one
pass without any loop (one uniform per node partitions [0, 1) among its children); `verify_tree_greedy` is the
greedy rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmspec.errors import check
from mmspec.sampling import race
from mmspec.tree import DraftTree
from mmspec.verify.base import Randomness, VerifyResult

NodeAcceptFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]
NodeRejectFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor],
                        tuple[torch.Tensor, torch.Tensor | None]]


def normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """weights / sum(weights) over the last axis; rows whose sum is 0 take `fallback` instead."""
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(1e-30), fallback)


def pick(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, V] at index [B] -> [B]."""
    return values.gather(-1, index.clamp_min(0).unsqueeze(-1)).squeeze(-1)


def sibling_rank(tree: DraftTree) -> torch.Tensor:
    """[B, N]: rank of each node among its siblings in node order (0 = first child)."""
    n = tree.num_nodes
    same_parent = tree.parents.unsqueeze(-1) == tree.parents.unsqueeze(-2)  # [B, N, N]
    earlier = torch.ones(n, n, dtype=torch.bool, device=tree.tokens.device).tril(-1)  # j < i
    return (same_parent & earlier & tree.valid.unsqueeze(-2)).sum(-1)


def tree_num_drafted(tree: DraftTree) -> torch.Tensor:
    """[B] depth of each row's tree (the most tokens a verify call can accept)."""
    return tree.depths.masked_fill(~tree.valid, 0).max(-1).values


def assemble_tree_result(tree: DraftTree, path: torch.Tensor, num_accepted: torch.Tensor,
                         final_token: torch.Tensor) -> VerifyResult:
    """Lay out tokens along the accepted path [B, D+1] (root first, -1 padded), then the final token."""
    depth = tree.max_depth
    along = tree.tokens.gather(1, path[:, 1:].clamp_min(0))  # [B, D]
    columns = torch.arange(depth + 1, device=path.device)  # [D+1]
    padded = torch.cat([along, along.new_full((along.shape[0], 1), -1)], dim=1)  # [B, D+1]
    output = torch.where(columns < num_accepted.unsqueeze(-1), padded, torch.full_like(padded, -1))
    output = torch.where(columns == num_accepted.unsqueeze(-1), final_token.unsqueeze(-1), output)
    flags = columns[:depth] < num_accepted.unsqueeze(-1)
    return VerifyResult(output_tokens=output, num_accepted=num_accepted, accepted_flags=flags,
                        num_drafted=tree_num_drafted(tree), accepted_nodes=path)


def children_by_rank(tree: DraftTree) -> torch.Tensor:
    """[B, N, C]: for every node as a parent, the index of its child of sibling rank s in column s, or -1 if it has
    none (C = tree.max_children)."""
    b, n = tree.tokens.shape
    c = tree.max_children
    rank = sibling_rank(tree)  # [B, N]
    sel = tree.valid & (tree.parents >= 0) & (rank < c)  # [B, N] drafted nodes
    slot = torch.where(sel, tree.parents * c + rank, torch.full_like(rank, n * c))  # [B, N] (parent, rank) or spare
    nodes = torch.arange(n, device=tree.tokens.device).expand(b, n)
    children = torch.full((b, n * c + 1), -1, dtype=torch.long, device=tree.tokens.device)
    children = children.scatter(1, slot, torch.where(sel, nodes, torch.full_like(nodes, -1)))
    return children[:, :n * c].view(b, n, c)


WALK_SCHEDULES = ("by_rank", "by_depth")


def walk_tree(tree: DraftTree, target_probs: torch.Tensor, rand: Randomness, accept_fn: NodeAcceptFn,
              reject_fn: NodeRejectFn, schedule: str | None = None) -> VerifyResult:
    """Verify a batch of trees. target_probs [B, N, V]: p for the token after each node.

    schedule: "by_rank" (`walk_by_rank`: every node at once, one step per sibling rank, no host sync) or "by_depth"
    (`walk_by_depth`: each row root to leaf, leaving its loops as soon as no row needs them, a host sync per step).
    They give identical results (tested). None = "by_depth" on CPU outside torch.compile, where a sync costs
    nothing and following only the accepted path does the least arithmetic (the LlamaGen bench's 59-node trees at
    batch 1, 2026-11-23: `lantern` 0.84x of vanilla by depth, 0.63x by rank), else "by_rank" (the GPU path:
    max_children static steps instead of max_depth x max_children, 3.7-3.8x fewer operations on those depth-4 trees,
    and compilable without graph breaks).
    """
    if schedule is None:
        on_cpu = target_probs.device.type == "cpu" and not torch.compiler.is_compiling()
        schedule = "by_depth" if on_cpu else "by_rank"
    check(schedule in WALK_SCHEDULES, f"schedule must be one of {', '.join(WALK_SCHEDULES)} or None, got {schedule!r}.")
    walk = walk_by_depth if schedule == "by_depth" else walk_by_rank
    return walk(tree, target_probs, rand, accept_fn, reject_fn)


def walk_by_rank(tree: DraftTree, target_probs: torch.Tensor, rand: Randomness, accept_fn: NodeAcceptFn,
                 reject_fn: NodeRejectFn) -> VerifyResult:
    """The walk for every node as a parent at once: step s tries each node's child of sibling rank s against that
    node's working distributions [B, N, V], and a rejection updates them (reject_fn). After the last rank each node
    knows its first accepted child, and its working p is what the walk samples from once all its children were
    rejected. The accepted path is the chain of first accepted children from the root (`deepest_matching_node`).
    Node functions apply elementwise over the leading [B, N] axes with each child's own uniform, so this is exactly
    the root-to-leaf walk, in max_children static steps instead of max_depth x max_children."""
    b, n, _ = target_probs.shape
    device = target_probs.device
    children = children_by_rank(tree)  # [B, N, C]
    tokens = tree.tokens.gather(1, children.clamp_min(0).flatten(1)).view_as(children)  # [B, N, C] (root's: none)
    uniforms = rand.uniforms.gather(1, children.clamp_min(0).flatten(1)).view_as(children)  # [B, N, C]
    p_work = target_probs  # [B, N, V] p at each node (as a parent), minus its rejected children
    q_work = tree.child_probs if tree.sampled else None  # [B, N, V] or None
    accepted = torch.full((b, n), -1, dtype=torch.long, device=device)  # [B, N] each node's first accepted child

    for s in range(tree.max_children):
        child = children[..., s]  # [B, N] each node's child of rank s
        x, u = tokens[..., s], uniforms[..., s]  # [B, N] its token and uniform
        trying = (child >= 0) & (accepted < 0)  # [B, N] parents with such a child, still searching
        ok = accept_fn(p_work, q_work, x, u) & trying
        accepted = torch.where(ok, child, accepted)
        rejected = (trying & ~ok).unsqueeze(-1)  # [B, N, 1]
        p_next, q_next = reject_fn(p_work, q_work, x)
        p_work = torch.where(rejected, p_next, p_work)
        if q_work is not None:
            q_work = torch.where(rejected, q_next, q_work)

    nodes = torch.arange(n, device=device)
    is_root = tree.valid & (tree.parents < 0)  # [B, N]
    chosen = tree.valid & (tree.parents >= 0) & (accepted.gather(1, tree.parents.clamp_min(0)) == nodes)
    paths, node = deepest_matching_node(tree, is_root | chosen)
    rows = torch.arange(b, device=device)
    # stopped at node: all its children rejected (the recovered token) or none there (a leaf: the bonus token)
    final_weights = normalise(p_work[rows, node], target_probs[rows, node])  # [B, V]
    depth = tree.depths[rows, node]  # [B] drafts accepted
    return assemble_tree_result(tree, paths[rows, node], depth, race(final_weights, rand.exponentials_at(depth)))


def walk_by_depth(tree: DraftTree, target_probs: torch.Tensor, rand: Randomness, accept_fn: NodeAcceptFn,
                  reject_fn: NodeRejectFn) -> VerifyResult:
    """The walk as papers write it, rows vectorised: from the root, try the current node's children in sibling
    order with its working distributions [B, V], descend into the first accepted one; a row whose children are all
    rejected (or that reached a leaf) stops. Each loop is left once no row needs it (a host sync per step)."""
    b, n = tree.tokens.shape
    device = tree.tokens.device
    rows = torch.arange(b, device=device)
    rank = sibling_rank(tree)  # [B, N]
    child_probs = tree.child_probs if tree.sampled else None  # [B, N, V] or None

    cur = torch.zeros(b, dtype=torch.long, device=device)  # [B] current node
    active = torch.ones(b, dtype=torch.bool, device=device)  # [B] still descending
    num_accepted = torch.zeros(b, dtype=torch.long, device=device)
    path = torch.full((b, tree.max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    p_work = target_probs[:, 0]  # [B, V]
    q_work = None if child_probs is None else child_probs[:, 0]  # [B, V]
    final_weights = torch.zeros_like(p_work)

    for depth in range(1, tree.max_depth + 1):
        if not bool(active.any()):
            break
        is_child = tree.valid & (tree.parents == cur.unsqueeze(-1))  # [B, N]
        chosen = torch.full((b,), -1, dtype=torch.long, device=device)  # [B] accepted child
        searching = active.clone()
        for s in range(tree.max_children):
            if not bool(searching.any()):
                break
            sel = is_child & (rank == s)  # [B, N] at most one node per row
            has = sel.any(-1) & searching  # [B]
            c = sel.long().argmax(-1)  # [B]
            x = tree.tokens[rows, c]  # [B]
            ok = accept_fn(p_work, q_work, x, rand.uniforms[rows, c]) & has
            chosen = torch.where(ok, c, chosen)
            rejected = (has & ~ok).unsqueeze(-1)  # [B, 1]
            p_next, q_next = reject_fn(p_work, q_work, x)
            p_work = torch.where(rejected, p_next, p_work)
            if q_work is not None:
                q_work = torch.where(rejected, q_next, q_work)
            searching = searching & ~ok
        went_down = active & (chosen >= 0)  # [B]
        stopped = (active & ~went_down).unsqueeze(-1)  # every child rejected, or a leaf
        final_weights = torch.where(stopped, p_work, final_weights)
        active = went_down
        cur = torch.where(went_down, chosen, cur)
        num_accepted = num_accepted + went_down.long()
        path[:, depth] = torch.where(went_down, cur, torch.full_like(cur, -1))
        p_work = torch.where(went_down.unsqueeze(-1), target_probs[rows, cur], p_work)
        if q_work is not None:
            q_work = torch.where(went_down.unsqueeze(-1), child_probs[rows, cur], q_work)

    final_weights = torch.where(active.unsqueeze(-1), p_work, final_weights)  # reached max depth: bonus
    final_weights = normalise(final_weights, target_probs[rows, cur])
    return assemble_tree_result(tree, path, num_accepted, race(final_weights, rand.exponentials_at(num_accepted)))


def deepest_matching_node(tree: DraftTree, matches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """matches [B, N] bool (a node's own test; the root must match) -> (paths [B, N, D+1], node [B]): the deepest
    valid node whose every ancestor matches too (lowest index on ties)."""
    paths = tree.paths()  # [B, N, D+1]
    on_path = paths >= 0
    path_ok = (matches.gather(1, paths.clamp_min(0).flatten(1)).view_as(paths) | ~on_path).all(-1)  # [B, N]
    score = torch.where(path_ok & tree.valid, tree.depths, torch.full_like(tree.depths, -1))
    return paths, score.argmax(-1)


def verify_tree_greedy(tree: DraftTree, target_probs: torch.Tensor) -> VerifyResult:
    """Greedy: the longest root-to-node path whose tokens equal the argmax at their parent (first on ties)."""
    best = target_probs.argmax(-1)  # [B, N] argmax after each node
    parent_best = best.gather(1, tree.parents.clamp_min(0))  # [B, N]
    matches = tree.valid & ((tree.tokens == parent_best) | (tree.parents < 0))  # root always matches
    paths, node = deepest_matching_node(tree, matches)
    rows = torch.arange(tree.batch_size, device=tree.tokens.device)
    return assemble_tree_result(tree, paths[rows, node], tree.depths[rows, node], best[rows, node])


def child_intervals(tree: DraftTree, target_probs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each drafted node's share of its parent's uniform: (lower [B, N] float64: the p at the parent of its earlier
    siblings, owned [B, N] float64: its own p at the parent, 0 for the root, invalid nodes and repeated sibling
    tokens; first_sibling [B, N]: the lowest-index node among its siblings, whose uniform the parent uses)."""
    b, n, v = target_probs.shape
    is_child = tree.valid & (tree.parents >= 0)  # [B, N]
    earlier = torch.ones(n, n, dtype=torch.bool, device=target_probs.device).tril(-1)  # [N, N] j < i
    sibling = (tree.parents.unsqueeze(-1) == tree.parents.unsqueeze(-2)) & is_child.unsqueeze(-2)  # [B, N, N] i~j
    repeated = (sibling & earlier & (tree.tokens.unsqueeze(-1) == tree.tokens.unsqueeze(-2))).any(-1)  # [B, N]
    flat = tree.parents.clamp_min(0) * v + tree.tokens.clamp_min(0)  # [B, N] (parent, token) in [B, N V]
    owned = target_probs.reshape(b, n * v).gather(1, flat).double()  # [B, N] p(token) at the parent
    owned = torch.where(is_child & ~repeated, owned, torch.zeros_like(owned))
    lower = ((sibling & earlier).double() @ owned.unsqueeze(-1)).squeeze(-1)  # [B, N]
    first_sibling = (sibling & ~earlier.transpose(0, 1)).long().argmax(-1)  # [B, N] first j <= i among siblings
    return lower, owned, first_sibling


def verify_tree_deterministic(tree: DraftTree, target_probs: torch.Tensor, rand: Randomness) -> VerifyResult:
    """Lossless verification of deterministic children (q = 1) in one vectorised pass: no loop over depths or
    siblings, no host sync, the same distribution as `walk_tree` with the lossless node functions.

    The sequential walk accepts sibling i with probability p(c_i) / (1 - p(c_1) - .. - p(c_{i-1})) once the earlier
    ones were rejected, so overall child c_i with probability p(c_i), and stops with the recovered token drawn from
    p without the children. One uniform per node decides that at once: child c_i of node n owns the interval
    [p(c_1) + .. + p(c_{i-1}), .. + p(c_i)) of [0, 1), and is accepted iff n's uniform falls in it (a repeated
    sibling token owns nothing, as the walk has removed it). Node n's uniform is `rand.uniforms` at its first child,
    so a one-branch tree uses the numbers a chain of the same drafts uses and gives the same tokens. The accepted
    path is the deepest node whose ancestors all hold their parent's accepted child; its final token is raced from
    p without its children (recovered) or, at a leaf, from p (bonus), with `rand.exponentials_at`."""
    b, n, v = target_probs.shape
    rows = torch.arange(b, device=target_probs.device)
    is_child = tree.valid & (tree.parents >= 0)  # [B, N] valid drafted nodes
    lower, owned, first_sibling = child_intervals(tree, target_probs)
    u = rand.uniforms.gather(1, first_sibling)  # [B, N] the parent's uniform
    matches = (is_child & (lower <= u) & (u < lower + owned)) | (tree.valid & (tree.parents < 0))
    paths, node = deepest_matching_node(tree, matches)
    p_node = target_probs[rows, node]  # [B, V]
    children = (is_child & (tree.parents == node.unsqueeze(-1))).to(p_node.dtype)  # [B, N]
    drafted = torch.zeros_like(p_node).scatter_add_(1, tree.tokens.clamp_min(0), children) > 0  # [B, V] its children
    weights = normalise(p_node.masked_fill(drafted, 0.0), p_node)
    depth = tree.depths[rows, node]  # [B] drafts accepted
    return assemble_tree_result(tree, paths[rows, node], depth, race(weights, rand.exponentials_at(depth)))
