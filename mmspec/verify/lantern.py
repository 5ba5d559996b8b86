"""LANTERN relaxed acceptance for visual AR models (lossy, with a total-variation bound). docs/verify.md, `lantern`.

Image tokens whose codebook latents are close are interchangeable enough that a draft x may borrow the
probability of its nearest latent neighbours N[x] (sorted by distance, x itself excluded):

    c = cumsum(p[N[x][:k]])
    delta form (LANTERN):    i* = max{i : c[i] <= delta}                 moved mass <= delta
    lambda form (LANTERN++): i* = max{i : c[i] <= (lambda - 1) p(x)}     p~(x) <= lambda p(x)
    p~(x) = p(x) + c[i*]   (p(x) when no i qualifies); accept x iff U < p~(x) / q(x)

On rejection of a draft without a distribution (one-hot q: Jacobi 'random' init, deterministic tree
children), x and the neighbours whose mass was moved to it are removed from p, so the output for a single
draft is exactly the relaxed distribution p~_x and TV(output, p) <= delta (`reject="moved"`, the default,
which is what the paper's bound needs). The public code instead zeroes the k+1 nearest neighbours whenever any
mass moved (`reject="code"`).

With a draft distribution q (sampled drafts; chain rows whose q is one-hot, such as freshly initialised Jacobi
positions, count as drafts without one) the residual is:
- `reject="moved"`: norm(max(p - q, 0)), the lossless residual (exactly lossless at delta = 0);
- `reject="code"`: the reference static-tree rule (jadohu/LANTERN `evaluate_posterior_v1`): when mass moved to x,
  q is zeroed at N[x][:k+1] first, then norm(max(p - q', 0)).
Neither keeps the TV <= delta bound: accepting with p~(x) / q(x) adds moved(x) / q(x), not moved(x), to x's
acceptance, so the extra mass can reach sum_x moved(x) (measured in docs/verify.md). The bound holds per candidate
for drafts without a distribution; trees that try several siblings can move more mass in total; `mmspec bench`
reports the measured effect (token calibration).

`greedy=True` (temperature 0): accept x iff it is the argmax of its relaxed distribution (p~(x) >= every remaining
p(y)), where p is the target's softmax of its logits (CFG applied; temperature 1, no top-k / top-p), as the
official greedy verification (`ea_model_llamagen.py`) relaxes it: the loop asks the target for it
(`greedy_reads_softmax`); the one-hot argmax would leave no mass to move. The token after the accepted drafts is
the target's argmax.

A table row may list x itself where x has fewer than k neighbours (a vocabulary of text and image tokens: a text
token has none, Emu3's table lists each text token as its own neighbour): such entries carry no mass.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmspec.errors import InputError, check, check_positive_int
from mmspec.tree import DraftTree
from mmspec.verify.base import AcceptanceRule, Randomness, VerifyResult, register_rule
from mmspec.verify.chain import gather_draft_probs, verify_chain
from mmspec.verify.tree_walk import assemble_tree_result, normalise, pick, walk_tree


# ----------------------------------------------------------------------------------------- neighbour table
def build_neighbour_table(codebook: torch.Tensor, k: int = 1000, chunk: int = 1024) -> torch.Tensor:
    """For every codebook entry, the indices of its k nearest other entries by L2 distance, nearest first.

    codebook [V, C] (the raw VQ codebook vectors, as LANTERN uses). Returns [V, min(k, V-1)], stored as
    int16-safe uint16 when V <= 65536 (compact; converted to int64 when used), else int32. Computed in chunks
    so a 16384-entry codebook needs no V x V matrix at once.
    """
    check(codebook.dim() == 2, f"codebook must be [V, C], got shape {list(codebook.shape)}.")
    v = codebook.shape[0]
    check(v >= 2, "codebook needs at least 2 entries.")
    check_positive_int("k", k)
    k = min(k, v - 1)
    book = codebook.detach().float()
    rows = []
    for start in range(0, v, chunk):
        block = book[start:start + chunk]  # [c, C]
        dist = torch.cdist(block, book)  # [c, V]
        dist[torch.arange(block.shape[0]), torch.arange(start, start + block.shape[0])] = float("inf")
        # stable: equal distances keep index order
        rows.append(torch.sort(dist, dim=-1, stable=True).indices[:, :k])
    table = torch.cat(rows)
    return table.to(torch.uint16 if v <= 65536 else torch.int32)


def load_or_build_neighbour_table(codebook: torch.Tensor, cache_path: str | Path | None,
                                  k: int = 1000) -> torch.Tensor:
    """Build the table once and cache it as safetensors at `cache_path` (rebuilt if the codebook changed)."""
    from safetensors.torch import load_file, save_file

    fingerprint = torch.tensor([float(codebook.double().sum()), float(codebook.double().abs().sum())])
    if cache_path is not None and Path(cache_path).is_file():
        cached = load_file(str(cache_path))
        if cached["neighbours"].shape[1] >= min(k, codebook.shape[0] - 1) and torch.allclose(
                cached["fingerprint"], fingerprint):
            return cached["neighbours"][:, :k]
    table = build_neighbour_table(codebook, k)
    if cache_path is not None:
        path = Path(cache_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        save_file({"neighbours": table.contiguous(), "fingerprint": fingerprint}, str(tmp))
        tmp.replace(path)
    return table


# ---------------------------------------------------------------------------------------------- the rule
@register_rule
class LanternRule(AcceptanceRule):
    """LANTERN (delta form) or LANTERN++ (lambda form) relaxed acceptance. See the module docstring."""

    name = "lantern"
    plain_step_samples_p = True
    lossless = False

    def __init__(self, neighbours: torch.Tensor, k: int = 1000, delta: float | None = 0.1,
                 lam: float | None = None, reject: str = "moved", greedy: bool = False) -> None:
        check(isinstance(neighbours, torch.Tensor) and neighbours.dim() == 2,
              "neighbours must be the [V, k] table from build_neighbour_table(codebook).")
        check_positive_int("k", k)
        if lam is not None:
            check(isinstance(lam, (int, float)) and lam >= 1, f"lam (lambda) must be >= 1, got {lam!r}.")
            delta = None
        else:
            check(delta is not None, "give delta (LANTERN) or lam (LANTERN++).")
            check(isinstance(delta, (int, float)) and 0 <= delta <= 1,
                  f"delta must be in [0, 1] (a total-variation budget), got {delta!r}.")
        check(reject in ("moved", "code"), f"reject must be 'moved' or 'code', got {reject!r}.")
        self.neighbours = neighbours
        self.k = min(k, neighbours.shape[1])
        self.delta = delta
        self.lam = lam
        self.reject = reject
        self.greedy = greedy
        self.uses_randomness = not greedy
        self.greedy_reads_softmax = greedy  # (LANTERN's greedy path relaxes the softmax of the logits)
        self.lossless = self.keeps_distribution(delta=delta, lam=lam)

    @classmethod
    def keeps_distribution(cls, delta: float | None = 0.1, lam: float | None = None, **_) -> bool:
        """Exact only when no mass can move: delta 0 (LANTERN) or lam 1 (LANTERN++)."""
        return lam == 1 if lam is not None else delta == 0

    def check_inputs(self, target_probs: torch.Tensor) -> None:
        super().check_inputs(target_probs)
        check_neighbour_table(self.neighbours, target_probs.shape[-1])

    def config(self) -> dict:
        return {"name": self.name, "k": self.k, "delta": self.delta, "lam": self.lam, "reject": self.reject,
                "greedy": self.greedy}

    # ------------------------------------------------------------------------------ relaxed probabilities
    def _neighbours_of(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[..., width] int64 neighbour ids of x [...] (x = -1 rows get entry 0's, masked by callers)."""
        table = self.neighbours.to(x.device)
        if table.dtype == torch.uint16:  # torch < 2.6 cannot index uint16 on the CPU: index its bits as int16
            return table.view(torch.int16)[x.clamp_min(0), :width].long() & 0xFFFF
        return table[x.clamp_min(0), :width].long()

    def relaxed(self, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """p [..., V], x [...] -> (p~(x) [...], number of neighbours whose mass moved to x [...])."""
        nb = self._neighbours_of(x, self.k)  # [..., k]
        mass = p.gather(-1, nb).masked_fill(nb == x.clamp_min(0).unsqueeze(-1), 0.0)  # x listed as itself: none
        cum = mass.cumsum(-1)  # [..., k] non-decreasing
        p_x = p.gather(-1, x.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [...]
        budget = (self.lam - 1) * p_x if self.lam is not None else torch.full_like(p_x, self.delta)
        moved_count = (cum <= budget.unsqueeze(-1)).sum(-1)  # [...] qualifying i form a prefix
        moved = torch.where(moved_count > 0, cum.gather(-1, (moved_count - 1).clamp_min(0).unsqueeze(-1))
                            .squeeze(-1), torch.zeros_like(p_x))
        return p_x + moved, moved_count

    def _without(self, p: torch.Tensor, x: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """p [..., V] with x and the neighbours flagged in drop [..., width] set to 0."""
        nb = self._neighbours_of(x, drop.shape[-1])  # [..., width]
        out = p.scatter(-1, x.clamp_min(0).unsqueeze(-1), 0.0)
        return out.scatter(-1, nb, torch.where(drop, 0.0, out.gather(-1, nb)))

    def remove_rejected(self, p: torch.Tensor, x: torch.Tensor, moved_count: torch.Tensor) -> torch.Tensor:
        """p without x and the neighbours the rule zeroes on rejection (unnormalised)."""
        width = min(self.k + 1, self.neighbours.shape[1])
        position = torch.arange(width, device=p.device)
        if self.reject == "moved":
            drop = position < moved_count.unsqueeze(-1)
        else:  # public code: the k+1 nearest, whenever any mass moved
            drop = (moved_count > 0).unsqueeze(-1) & (position >= 0)
        return self._without(p, x, drop)

    def residual(self, p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """The unnormalised weights [..., V] a rejection of draft x [...] leaves: without a distribution (q None) p
        without x and the neighbours `reject` names; with q [..., V], max(p - q, 0), where `reject="code"` first
        zeroes q at N[x][:k+1] when mass moved to x (the reference static-tree rule)."""
        _, moved = self.relaxed(p, x)
        if q is None:
            return self.remove_rejected(p, x, moved)
        if self.reject == "code":
            width = min(self.k + 1, self.neighbours.shape[1])
            nb = self._neighbours_of(x, width)  # [..., k+1]
            q = q.scatter(-1, nb, torch.where((moved > 0).unsqueeze(-1), 0.0, q.gather(-1, nb)))
        return (p - q).clamp_min(0)

    def _is_relaxed_argmax(self, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x is the argmax of its relaxed distribution: p~(x) >= p(y) for every y not absorbed into x."""
        p_tilde, moved = self.relaxed(p, x)
        absorbed = torch.arange(self.k, device=p.device) < moved.unsqueeze(-1)
        return p_tilde >= self._without(p, x, absorbed).max(-1).values

    # ------------------------------------------------------------------------------------------- chains
    def verify_chain(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, rand: Randomness | None,
                     num_draft: torch.Tensor) -> VerifyResult:
        k = draft_tokens.shape[1]
        if self.greedy:
            return self._verify_chain_greedy(draft_tokens, target_probs, num_draft)

        def accept_fn(tokens, p, q, u):  # [B, K] each
            p_tilde, _ = self.relaxed(p[:, :k], tokens)
            q_x = 1.0 if q is None else gather_draft_probs(q, tokens).double()
            return u * q_x < p_tilde.double()

        def residual_fn(p_j, q_j, x_j):
            if q_j is None:
                return self.residual(p_j, None, x_j)
            # rows whose q is one-hot (e.g. freshly initialised Jacobi positions) are drafts without a distribution
            one_hot = (q_j.max(-1, keepdim=True).values >= 1 - 1e-6)
            return torch.where(one_hot, self.residual(p_j, None, x_j), self.residual(p_j, q_j, x_j))

        out, acc, flags = verify_chain(draft_tokens, target_probs, draft_probs, rand.uniforms,
                                       rand.exponentials_at, num_draft, accept_fn, residual_fn)
        return VerifyResult(out, acc, flags, num_draft)

    def _verify_chain_greedy(self, draft_tokens, target_probs, num_draft) -> VerifyResult:
        from mmspec.verify.chain import count_leading

        b, k = draft_tokens.shape
        positions = torch.arange(k, device=draft_tokens.device)
        ok = self._is_relaxed_argmax(target_probs[:, :k], draft_tokens) & (positions < num_draft.unsqueeze(-1))
        acc = count_leading(ok)
        final = target_probs.argmax(-1).gather(1, acc.unsqueeze(-1))  # [B, 1]
        cols = torch.arange(k + 1, device=draft_tokens.device)
        padded = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), -1)], 1)
        out = torch.where(cols < acc.unsqueeze(-1), padded, torch.full_like(padded, -1))
        out = torch.where(cols == acc.unsqueeze(-1), final, out)
        return VerifyResult(out, acc, positions < acc.unsqueeze(-1), num_draft)

    # -------------------------------------------------------------------------------------------- trees
    def verify_tree(self, tree: DraftTree, target_probs: torch.Tensor, rand: Randomness | None) -> VerifyResult:
        if self.greedy:
            return self._verify_tree_greedy(tree, target_probs)

        def accept_fn(p_work, q_work, x, u):
            p_tilde, _ = self.relaxed(p_work, x)
            q_x = 1.0 if q_work is None else pick(q_work, x).double()
            return u * q_x < p_tilde.double()

        def reject_fn(p_work, q_work, x):
            p_next = normalise(self.residual(p_work, q_work, x), p_work)
            if q_work is None:
                return p_next, None
            return p_next, normalise(q_work.scatter(-1, x.unsqueeze(-1), 0.0), torch.zeros_like(q_work))

        return walk_tree(tree, target_probs, rand, accept_fn, reject_fn)

    def _verify_tree_greedy(self, tree: DraftTree, target_probs: torch.Tensor) -> VerifyResult:
        parent_p = target_probs.gather(1, tree.parents.clamp_min(0).unsqueeze(-1)
                                       .expand(-1, -1, target_probs.shape[-1]))  # [B, N, V]
        matches = tree.valid & (self._is_relaxed_argmax(parent_p, tree.tokens) | (tree.parents < 0))
        paths = tree.paths()  # [B, N, D+1]
        ok = (matches.gather(1, paths.clamp_min(0).flatten(1)).view_as(paths) | (paths < 0)).all(-1)
        score = torch.where(ok & tree.valid, tree.depths, torch.full_like(tree.depths, -1))
        node = score.argmax(-1)
        rows = torch.arange(tree.batch_size, device=tree.tokens.device)
        final = target_probs.argmax(-1)[rows, node]
        return assemble_tree_result(tree, paths[rows, node], tree.depths[rows, node], final)


def check_neighbour_table(neighbours: torch.Tensor, vocab_size: int) -> None:
    if neighbours.shape[0] != vocab_size:
        raise InputError(f"the LANTERN neighbour table covers {neighbours.shape[0]} tokens but the target's "
                         f"vocabulary has {vocab_size}; build it from this model's codebook.")
