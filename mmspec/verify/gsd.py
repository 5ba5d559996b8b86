"""GSD grouped acceptance for visual AR models (lossy, training-free, on Jacobi drafts). docs/verify.md, `gsd`.

The accepted token is the draft x itself, but acceptance is judged on a group around it: the g tokens nearest
to x by target-probability rank, kept only where their probability is within p_thr of p(x) and (when an
embedding table E is given) their embedding is within squared distance d_thr of E[x]:

    G = ranks [r - g//2, r - g//2 + g) of argsort(p) around x's rank r
    m = (|p[G] - p(x)| < p_thr) & (||E[x] - E[G]||^2 < d_thr)           x itself always qualifies
    accept x iff U < min(1, sum(p[G] m) / sum(q[G] m)); else resample from norm(max(p - q, 0)) and stop

With g = 1 this is exactly lossless speculative sampling. The paper's theorem says acceptance >= plain speculative
sampling's because grouping shrinks TV(p, q); that is exact for a fixed partition of the vocabulary, but GSD's windows
overlap: measured, it fails on about 5% of random (p, q) pairs, and GSD's output has no total-variation bound
(docs/verify.md has both measurements).

Defaults follow the paper (g = 50, its PartiPrompts setting; g = 25 for COCO). E is the target's own input-embedding
table in the official code (Lumina-mGPT's `embed_tokens`); which table a pipeline passes is its choice
(LlamaGen: `embeddings="target"` by default, `"codebook"` for the VQ codebook). Near the ends of the ranking the
window is placed by `group_window`:
- "shifted" (default): moved to stay inside the vocabulary, so every group has g members;
- "code" (the public code's slice `[r - 7 : r + 7]` with g = 14): truncated at the top of the ranking (the argmax
  token gets g//2 lower-ranked neighbours), and for r < g//2 the slice is empty, the code's `max()` of it raises and
  its `except` falls back to plain speculative sampling (the group is x alone).
`GSDRule.reference_code()` is the code's g = 14, p_thr = 0.15, d_thr = 0.5 and window. The sort is done once per
verify call, batched.

Trees (an mmspec extension; the paper only verifies Jacobi chains): each child is judged by the same grouped
test against the working p at its parent, and a rejected child leaves the lossless tree residual (x removed
from p for deterministic children, norm(max(p - q, 0)) for sampled ones), so with g = 1 it is exactly lossless
tree verification. This is the "grouped acceptance on EAGLE trees" combination (docs/eagle_lantern.md).
"""

from __future__ import annotations

import torch

from mmspec.errors import InputError, check, check_positive_int
from mmspec.tree import DraftTree
from mmspec.verify.base import AcceptanceRule, Randomness, VerifyResult, register_rule
from mmspec.verify.chain import lossless_residual, verify_chain
from mmspec.verify.lossless import lossless_node_reject
from mmspec.verify.tree_walk import walk_tree

GSD_WINDOWS = ("shifted", "code")


@register_rule
class GSDRule(AcceptanceRule):
    """Grouped speculative decoding acceptance (chains, and trees as an extension). See the module docstring."""

    name = "gsd"
    plain_step_samples_p = True
    lossless = False
    supports_tree = True

    def __init__(self, group_size: int = 50, p_thr: float = 0.15, d_thr: float = 0.5,
                 embeddings: torch.Tensor | None = None, group_window: str = "shifted") -> None:
        check_positive_int("group_size (g)", group_size)
        check(isinstance(p_thr, (int, float)) and p_thr > 0, f"p_thr must be > 0, got {p_thr!r}.")
        check(isinstance(d_thr, (int, float)) and d_thr > 0, f"d_thr must be > 0, got {d_thr!r}.")
        check(embeddings is None or (isinstance(embeddings, torch.Tensor) and embeddings.dim() == 2),
              "embeddings must be a [V, C] token-embedding table (e.g. the VQ codebook) or None.")
        check(group_window in GSD_WINDOWS, f"group_window must be one of {GSD_WINDOWS}, got {group_window!r}.")
        self.group_size = group_size
        self.p_thr = p_thr
        self.d_thr = d_thr
        self.embeddings = embeddings
        self.group_window = group_window
        self.lossless = self.keeps_distribution(group_size=group_size)

    @classmethod
    def keeps_distribution(cls, group_size: int = 50, **_) -> bool:
        """Exact only with groups of one (plain speculative sampling)."""
        return group_size == 1

    def check_inputs(self, target_probs: torch.Tensor) -> None:
        super().check_inputs(target_probs)
        v = target_probs.shape[-1]
        if self.embeddings is not None and self.embeddings.shape[0] != v:
            raise InputError(f"GSD embeddings have {self.embeddings.shape[0]} rows but the vocabulary has {v}.")

    @classmethod
    def reference_code(cls, embeddings: torch.Tensor | None = None) -> GSDRule:
        """The public code's settings: g = 14, p_thr = 0.15, d_thr = 0.5, its window at the ends of the ranking."""
        return cls(group_size=14, p_thr=0.15, d_thr=0.5, embeddings=embeddings, group_window="code")

    def config(self) -> dict:
        return {"name": self.name, "group_size": self.group_size, "p_thr": self.p_thr, "d_thr": self.d_thr,
                "embeddings": self.embeddings is not None, "group_window": self.group_window}

    def group(self, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """p [..., V], x [...] -> (group token ids [..., g], membership mask m [..., g]); with window="code" the
        slots outside the code's slice are masked out (their ids repeat an edge token)."""
        v = p.shape[-1]
        g = min(self.group_size, v)
        order = torch.sort(p, dim=-1, stable=True).indices  # [..., V] ascending, like the public code
        rank_of = torch.empty_like(order).scatter_(-1, order, torch.arange(v, device=p.device).expand_as(order))
        rank = rank_of.gather(-1, x.clamp_min(0).unsqueeze(-1))  # [..., 1]
        offsets = torch.arange(g, device=p.device)  # [g]
        if self.group_window == "shifted":
            slots = (rank - g // 2).clamp(0, v - g) + offsets  # [..., g]
            in_slice = torch.ones_like(slots, dtype=torch.bool)
        else:  # the code's slice: truncated at the top; empty below rank g//2, where the code falls back to x alone
            slots = rank - g // 2 + offsets  # [..., g]
            in_slice = (slots < v) & (rank >= g // 2)
        is_x = slots == rank  # [..., g] x's own slot, exactly once
        members = order.gather(-1, slots.clamp(0, v - 1))  # [..., g]
        p_members = p.gather(-1, members)
        p_x = p.gather(-1, x.clamp_min(0).unsqueeze(-1))
        mask = (p_members - p_x).abs() < self.p_thr  # [..., g]
        if self.embeddings is not None:
            emb = self.embeddings.to(device=p.device, dtype=torch.float32)
            dist = (emb[members] - emb[x.clamp_min(0)].unsqueeze(-2)).pow(2).sum(-1)  # [..., g]
            mask = mask & (dist < self.d_thr)
        return members, (mask & in_slice) | is_x

    def group_masses(self, p: torch.Tensor, q: torch.Tensor | None,
                     x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum_G p m, sum_G q m) for drafts x [...]; q None means one-hot drafts (q = 1 at x)."""
        members, mask = self.group(p, x)
        p_group = (p.gather(-1, members) * mask).sum(-1)
        if q is None:  # one-hot at x: x's slot is always in the group, exactly once
            q_group = torch.ones_like(p_group)
        else:
            q_group = (q.gather(-1, members) * mask).sum(-1)
        return p_group, q_group

    def verify_chain(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, rand: Randomness,
                     num_draft: torch.Tensor) -> VerifyResult:
        k = draft_tokens.shape[1]

        def accept_fn(tokens, p, q, u):
            p_group, q_group = self.group_masses(p[:, :k], q, tokens)
            return u * q_group.double() < p_group.double()

        out, acc, flags = verify_chain(draft_tokens, target_probs, draft_probs, rand.uniforms,
                                       rand.exponentials_at, num_draft, accept_fn, lossless_residual)
        return VerifyResult(out, acc, flags, num_draft)

    def verify_tree(self, tree: DraftTree, target_probs: torch.Tensor, rand: Randomness) -> VerifyResult:
        def accept_fn(p_work, q_work, x, u):  # p_work/q_work [B, V], x/u [B]
            p_group, q_group = self.group_masses(p_work, q_work, x)
            return u * q_group.double() < p_group.double()

        return walk_tree(tree, target_probs, rand, accept_fn, lossless_node_reject)
