"""EAGLE-2 tree drafting with a feature drafter: the loop drafter shared by every family whose drafter reads the
target's hidden states (LlamaGen's EAGLE/LANTERN drafter, the VLM drafters).

A feature drafter model pairs a token with a target feature: element j of its sequence is the pair
(f_j, tok_j), where f_j is the target's final normed hidden state at the position that PREDICTS tok_j, and its
output h_j regresses f_{j+1}. The model provides `new_cache(rows, capacity)`, `forward_cached(tokens,
positions, cache, slots, mask, features=...)` returning logits [R, S, V], and `last_hidden` [R, S, dim] (its
output features). The target exposes `last_hidden` [R, N, dim] after each forward.

Feature bookkeeping, per row (n = tokens committed by the target, root = tok_n = `state.last_token`):

- pending pairs: (f_j, tok_j) for the tokens the drafter has not yet run with TRUE target features; they end
  with the root's pair (f_n, tok_n). A family's `begin` fills the drafter's cache with what comes before (the
  prompt's pairs for a VLM, nothing for LlamaGen) and sets the first pending pair.
- propose: run the pending pairs at slots `lengths + [0, W)` (W = depth + 1; unused columns are scratch), at
  positions `slot + position_offset`; the output at the root's pair, h_n, scores the root's children. A
  candidate x with parent node u runs as the pair (drafter output of u, x) at position root + depth(x) and at
  pool slot root + id(x) with tree attention (`mmspec.lm.CandidatePool`); its output scores x's children.
- observe: the target's verify forward left `last_hidden` [R, N, dim] at every tree node; the feature at node
  u predicts u's child. With accepted path root = u_0, u_1..u_k and final (recovered / bonus) token y, the new
  pending pairs are (H[u_0], tok(u_1)), .., (H[u_{k-1}], tok(u_k)), (H[u_k], y). The old pending pairs are
  committed to the drafter's cache (they ran with true features); tree entries are dropped (overwritten).
- a chain (top_k = 1, what a draft budget mostly picks on a CPU) skips the pool: draft d sits at slot root + d and
  the cache's causal mask is its tree mask (`propose_chain`; the same tree as the pool's, with fewer operations),
  and the target, the acceptance rule and the commit take their chain forms for it (`DraftTree.is_chain`).

Children are the deterministic top-k of the drafter's log-probs, and the tree keeps the nodes of highest cumulative
log-prob. `child_ranking="raw"` (the default, EAGLE's code) ranks by the drafter's raw log-softmax at every
temperature; `"processed"` ranks after the target's sampling processing (temperature, top-k, top-p). Either way
the lossless tree rule accepts a child c with probability p(c) (the drafted set is a deterministic function of
the drafter), so the choice changes how much is accepted, never the output distribution.
Classifier-free guidance (`guidance_scale`): the drafter runs 2B rows and combines its logits like the target
(`mmspec.lm.GuidedRunner`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmspec.cache import StaticKVCache
from mmspec.compile import has_compiled_forward
from mmspec.errors import InputError, check, check_positive_int
from mmspec.lm import CandidatePool, GuidedRunner, PendingTokens, ShapedTreeDrafter, TokenLayout
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams, process_logits
from mmspec.tree import DraftTree, TreeShape, chain_as_tree, expand_eagle2, max_chain_depth, pool_size
from mmspec.verify import VerifyResult


class PendingPairs(PendingTokens):
    """Pending (feature, token) pairs: `PendingTokens` plus their target features [R, W, dim] (R = 2B with CFG)."""

    def __init__(self, last_token: torch.Tensor, features: torch.Tensor, width: int):
        super().__init__(last_token, width)
        self.features = features.new_zeros(features.shape[0], width, features.shape[-1])  # [R, W, dim]
        self.features[:, 0] = features

    def append(self, tokens: torch.Tensor, rows: torch.Tensor, features: torch.Tensor,
               feature_rows: torch.Tensor) -> None:
        """`PendingTokens.append` plus features [R, dim] for feature_rows [R] bool."""
        r, width = self.features.shape[:2]
        column = self.count.clamp_max(width - 1).repeat(r // self.count.shape[0])  # [R] each row's first free column
        every = torch.arange(r, device=column.device)
        kept = self.features[every, column]  # [R, dim]
        self.features[every, column] = torch.where(feature_rows.unsqueeze(-1), features, kept)  # one column per row
        super().append(tokens, rows)

    def select_rows(self, rows: torch.Tensor, feature_rows: torch.Tensor) -> None:
        """Keep only rows [B'] of the tokens and feature_rows [R'] of the features (both halves with CFG)."""
        super().select_rows(rows)
        self.features = self.features.index_select(0, feature_rows)

    def set_pairs(self, tokens: torch.Tensor, count: torch.Tensor, rows: torch.Tensor, features: torch.Tensor,
                  feature_rows: torch.Tensor) -> None:
        """rows [B] / feature_rows [R] bool take tokens [B, <=W], count [B] and features [R, <=W, dim]."""
        self.set(tokens, count, rows)
        padded = torch.zeros_like(self.features)
        padded[:, : features.shape[1]] = features
        self.features = torch.where(feature_rows[:, None, None], padded, self.features)


def feature_drafter_loss(pred: torch.Tensor, next_features: torch.Tensor, next_logits: torch.Tensor,
                         head: Callable[[torch.Tensor], torch.Tensor], p_weight: float = 0.1,
                         mask: torch.Tensor | None = None, rank_weight: float = 0.0) -> tuple[torch.Tensor, ...]:
    """EAGLE's training loss for a feature drafter:

        loss = SmoothL1(h_i, f_{i+1}) + p_weight * (CE(softmax(target logits_{i+1}), log_softmax(head(h_i)))
                                                    + rank_weight * top-10 ranking loss)

    (rank_weight 0: EAGLE's; 0.1: ViSpec's stage 1, `topk_ranking_loss`).

    pred h [B, S, H], next_features f [B, S, H], next_logits [B, S, V] (the target's logits at those
    features), head: the target's LM head on drafter features; mask [B, S] bool selects the positions that count
    (all when None). Returns (loss, feature SmoothL1, soft CE, top-1 agreement of the drafter's and the target's
    next token); the last three detached."""
    weight = position_weights(pred.shape[:2], mask, pred.device)  # [B, S]
    vloss = feature_smoothl1(pred, next_features, mask)
    logp = torch.log_softmax(head(pred).float(), dim=-1)  # [B, S, V]
    target_logits = next_logits.float()
    target_probs = torch.softmax(target_logits, dim=-1)  # [B, S, V]
    ploss = (-(target_probs * logp).sum(-1) * weight).sum()
    if rank_weight:
        ploss = ploss + rank_weight * topk_ranking_loss(logp, target_probs, 10, mask)
    agree = ((logp.argmax(-1) == target_logits.argmax(-1)).float() * weight).sum()
    return vloss + p_weight * ploss, vloss.detach(), ploss.detach(), agree.detach()


def position_weights(shape: torch.Size, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """[B, S] weights averaging over the positions mask [B, S] bool keeps (all when None): 1 / count where kept."""
    keep = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask
    return keep.float() / keep.float().sum().clamp_min(1.0)


def feature_smoothl1(pred: torch.Tensor, next_features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE's feature regression: SmoothL1(h_i, f_{i+1}) [B, S, H] averaged over channels and the positions mask
    [B, S] keeps (all when None)."""
    per_position = torch.nn.functional.smooth_l1_loss(pred.float(), next_features.float(), reduction="none")
    return (per_position.mean(-1) * position_weights(pred.shape[:2], mask, pred.device)).sum()


def topk_ranking_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor, k: int = 10,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """ViSpec's ranking loss: the Plackett-Luce negative log-likelihood of the target's top-k order under the
    drafter's logits, -sum_j log(exp(z_j) / sum_{l >= j} exp(z_l)) with z the drafter's logits at the target's k
    most likely tokens in decreasing order. draft_logits, target_probs [B, S, V]; mask [B, S] bool (all when
    None); the mean over the masked positions."""
    order = target_probs.topk(k, dim=-1).indices  # [B, S, k]
    z = draft_logits.float().gather(-1, order)  # [B, S, k]
    tail = torch.logcumsumexp(z.flip(-1), dim=-1).flip(-1)  # [B, S, k] log sum_{l >= j} exp(z_l)
    nll = -(z - tail).sum(-1)  # [B, S]
    return masked_mean(nll, mask)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """values [B, S] averaged over mask [B, S] bool (all when None)."""
    if mask is None:
        return values.mean()
    weight = mask.float()
    return (values * weight).sum() / weight.sum().clamp_min(1.0)


def distribution_l1_loss(pred: torch.Tensor, next_logits: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                         mask: torch.Tensor | None = None, l1_weight: float = 10.0, rank_weight: float = 0.1,
                         rank_k: int = 10) -> tuple[torch.Tensor, ...]:
    """ViSpec's stage-2 loss (no feature regression):

        loss = l1_weight * sum_v |softmax(head(h_i)) - softmax(target logits_{i+1})| + rank_weight * ranking loss

    pred h [B, S, H], next_logits [B, S, V], mask [B, S] bool. Returns (loss, L1, ranking loss, top-1 agreement);
    the last three detached."""
    draft_logits = head(pred).float()  # [B, S, V]
    p = torch.softmax(next_logits.float(), dim=-1)  # [B, S, V] the target's
    l1 = masked_mean((torch.softmax(draft_logits, dim=-1) - p).abs().sum(-1), mask)
    rank = topk_ranking_loss(draft_logits, p, rank_k, mask)
    agree = masked_mean((draft_logits.argmax(-1) == p.argmax(-1)).float(), mask)
    return l1_weight * l1 + rank_weight * rank, l1.detach(), rank.detach(), agree.detach()


def gather_nodes(values: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """values [R, N, D] at node indices nodes [R, P] (-1 padding reads node 0) -> [R, P, D]."""
    index = nodes.clamp_min(0).unsqueeze(-1).expand(-1, -1, values.shape[-1])  # [R, P, D]
    return values.gather(1, index)


def check_tree_params(top_k: int, depth: int, total_tokens: int) -> int:
    """Validate the EAGLE-2 tree size; return the candidate pool size 1 + top_k + (depth - 1) * top_k^2."""
    for name, value in (("top_k", top_k), ("depth", depth)):
        check_positive_int(name, value)
    check_positive_int("total_tokens", total_tokens, minimum=2)
    pool = pool_size(top_k, depth)
    check(total_tokens <= pool, f"total_tokens={total_tokens} exceeds the {pool} nodes depth={depth}, "
                                f"top_k={top_k} can create; lower total_tokens or raise depth/top_k.")
    return pool


CHILD_RANKINGS = ("raw", "processed")  # see the module docstring


class FeatureTreeDrafter(ShapedTreeDrafter):
    """The loop's drafter: EAGLE-2 dynamic trees from a feature drafter model over the target's features (see the
    module docstring). Families subclass it and implement `begin(inputs, state)`, which makes the drafter's cache
    (`self.runner.cache`) and the first pending pairs (`self.pending`)."""

    def __init__(self, model, target, params: SamplingParams, *, top_k: int, depth: int, total_tokens: int,
                 position_offset: int | torch.Tensor, guidance_scale: float | torch.Tensor | None = None,
                 child_ranking: str = "raw", layout: TokenLayout | None = None):
        check(child_ranking in CHILD_RANKINGS, f"child_ranking must be one of {', '.join(CHILD_RANKINGS)}, got "
                                               f"{child_ranking!r}.")
        self.child_ranking = child_ranking
        self.max_pool = check_tree_params(top_k, depth, total_tokens)
        self.model, self.target, self.params = model, target, params
        self.top_k, self.depth, self.total = top_k, depth, total_tokens
        self.full_shape = TreeShape(top_k, depth, total_tokens)  # what a draft budget may shrink
        # drafter element at cache slot j sits at position j + offset: an int, or [B] per row (set by `begin`)
        self.position_offset = position_offset
        self.width = self.pending_width()  # pending pairs: an accepted path + the final token, plain steps' pairs
        self.runner = GuidedRunner(model, guidance_scale)
        self.pending: PendingPairs | None = None
        self.room_base = 0  # the drafter cache's capacity before the candidate pool's room (`new_drafter_cache`)
        # the target's TokenLayout, for drafters whose cache slot j holds generated token j (image drafters): the
        # children of a node at slot s are generated token s + 1 and are ranked among the tokens allowed there
        self.layout = layout

    @property
    def max_draft_nodes(self) -> int:
        """Tree nodes one verify writes into the target's cache (the root included): room the target must keep."""
        return self.total

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def begin(self, inputs: Any, state: DecodeState) -> None:
        raise NotImplementedError

    def new_drafter_cache(self, rows: int, base: int) -> StaticKVCache:
        """The drafter's cache for a call (set as `self.runner.cache` and returned): `base` slots (the prompt's
        pairs the drafter keeps, the generated tokens, the pending width) plus room for a chain of the deepest
        depth a budget may draft; the candidate pool of a tree, up to 1 + top_k + (depth - 1) top_k^2 slots (711
        for the VLM drafters' paper tree), is added when a tree is drafted (`room_for_pool`), so calls that draft
        chains do not allocate and zero it (the world LLaVA's drafter cache at batch 8: 989 slots with it, 295
        without; in the decode loop a begin that made the larger cache took 2.5 ms more a call, 15.0 ms against 12.5,
        when the prompt pass still ran the whole layer). A compiled drafter (static shapes) gets the full shape's
        pool at once."""
        chains = pool_size(1, max_chain_depth(self.full_shape))  # a chain of depth d: d + 1 slots from its root
        room = self.max_pool if has_compiled_forward(self.model) else chains
        self.room_base = base
        self.runner.cache = self.model.new_cache(rows, base + room)
        return self.runner.cache

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows [B'] of the call (the loop drops finished rows): the drafter's cache, its pending pairs
        and per-row position offsets."""
        feature_rows = self.runner.model_rows(rows)  # [R'] (before the runner's rows change)
        self.runner.select_rows(rows)
        self.pending.select_rows(rows, feature_rows)
        if isinstance(self.position_offset, torch.Tensor) and self.position_offset.dim() > 0:  # [B] per row
            self.position_offset = self.position_offset.index_select(0, rows)

    def room_for_pool(self, pool: int) -> None:
        """Grow the drafter cache to hold a candidate pool of `pool` slots after `room_base` (a host-side bound: no
        device read)."""
        self.runner.cache.grow(self.room_base + pool)

    def _offset(self, trailing: int) -> int | torch.Tensor:
        """The position offset, shaped to add to [B] (trailing 0) or [B, S] (trailing 1) slots."""
        offset = self.position_offset
        return offset.view(-1, *([1] * trailing)) if isinstance(offset, torch.Tensor) else offset

    def target_features(self, rows: int, positions: int, when: str) -> torch.Tensor:
        """The target's `last_hidden` [R, positions, dim], checked to come from the forward we expect."""
        h = getattr(self.target, "last_hidden", None)
        ok = h is not None and h.dim() == 3 and tuple(h.shape[:2]) == (rows, positions)
        if not ok:
            raise InputError(f"the feature drafter reads the target's features of its {when} from the target's "
                             f"last_hidden, expected [{rows}, {positions}, dim], got "
                             f"{None if h is None else list(h.shape)}; run it with the pipeline's own target.")
        return h

    def log_probs(self, logits: torch.Tensor, child_index: torch.Tensor) -> torch.Tensor:
        """CFG-combined drafter logits [B, F, V] of children at generated-token index child_index [B] -> log-probs
        used to rank them [B, F, V] (the target's layout first, when it has one)."""
        if self.layout is not None:
            logits = self.layout.constrain(logits, child_index.unsqueeze(-1).expand(logits.shape[:2]))
        if self.child_ranking == "processed" and not self.params.greedy:
            logits = process_logits(logits, self.params.temperature, self.params.top_k, self.params.top_p)
        return torch.log_softmax(logits.float(), dim=-1)

    def run_pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the pending pairs (not committed). Returns the root's CFG-combined logits [B, V], the drafter's
        output feature at the root's pair [R, dim] (h_n: the predicted f_{n+1}) and the root's slot [B]. A compiled
        drafter (static shapes) always runs all `width` columns: one shape, where the pending count (the accepted
        depth, or the plain steps since a draft) would make each of its values a compilation. An eager forward of
        a model that `runs_one_column` writes every pair's K/V and runs the root's pair alone past them."""
        runner, pending = self.runner, self.pending
        compiled = has_compiled_forward(self.model)
        columns = self.width if compiled else self.pending_columns
        slots = runner.slots(columns)  # [B, C]; columns past a row's count are scratch
        positions = slots + self._offset(1)  # [B, C]
        last = (pending.count - 1).clamp(0, columns - 1)  # [B] the root's pair (finished rows: any column)
        batch = torch.arange(slots.shape[0], device=slots.device)
        tokens, features = pending.tokens[:, :columns], pending.features[:, :columns]  # [B, C], [R, C, dim]
        if columns > 1 and not compiled and getattr(self.model, "runs_one_column", False):
            # every pair's K/V, the root's pair alone past them (`run_layer_column`): the world LLaVA's EagleVLM
            # drafter after a chain of 8 on a 2-core CPU, 9 columns in 2.0 ms where the whole pass took 3.4 at
            # batch 32 (1.3 and 1.9 at batch 8)
            logits = runner.forward(tokens, positions, slots, features=features,
                                    query_column=runner.rows(last))  # [B, 1, V]
            return logits[:, 0], self.model.last_hidden[:, 0], slots[batch, last]
        logits = runner.forward(tokens, positions, slots, features=features)  # [B, C, V]
        root_hidden = gather_nodes(self.model.last_hidden, runner.rows(last).unsqueeze(-1))[:, 0]  # [R, dim]
        return logits[batch, last], root_hidden, slots[batch, last]

    def propose(self, state: DecodeState) -> DraftTree:
        return self.propose_chain(state) if self.top_k == 1 else self.propose_tree(state)

    def propose_tree(self, state: DecodeState) -> DraftTree:
        """EAGLE-2 expansion over a candidate pool in the drafter's cache (`mmspec.lm.CandidatePool`)."""
        runner, model = self.runner, self.model
        size = pool_size(self.top_k, self.depth)  # the pool this shape's expansion fills (<= max_pool)
        self.room_for_pool(size)
        root_logits, root_hidden, root_slot = self.run_pending()  # [B, V], [R, dim], [B]
        pool = CandidatePool(root_slot, size, runner.cache.capacity)
        pool_features = root_hidden.new_zeros(root_hidden.shape[0], size, root_hidden.shape[-1])  # [R, P, dim]
        pool_features[:, 0] = root_hidden

        def score(tokens: torch.Tensor, ids: torch.Tensor, parent_ids: torch.Tensor, depth: int) -> torch.Tensor:
            if depth == 0:
                return self.log_probs(root_logits.unsqueeze(1), root_slot + 1)  # [B, 1, V]
            mask = pool.mask(ids, parent_ids)  # [B, F, T]
            features = gather_nodes(pool_features, runner.rows(parent_ids))  # [R, F, dim] the parents' outputs
            positions = (root_slot + self._offset(0) + depth).unsqueeze(-1).expand_as(ids)  # [B, F]
            out = runner.forward(tokens, positions, pool.slots(ids), mask=mask, features=features)  # [B, F, V]
            index = runner.rows(ids).unsqueeze(-1).expand(-1, -1, pool_features.shape[-1])  # [R, F, dim]
            pool_features.scatter_(1, index, model.last_hidden)
            return self.log_probs(out, root_slot + 1 + depth)

        return expand_eagle2(state.last_token, score, top_k=self.top_k, depth=self.depth, total_tokens=self.total)

    def propose_chain(self, state: DecodeState) -> DraftTree:
        """top_k = 1: the tree `expand_eagle2` builds (the best child of each level's one node), without its
        candidate pool: draft d sits at slot root + d and sees every slot up to its own, the cache's causal mask."""
        runner = self.runner
        logits, hidden, root_slot = self.run_pending()  # [B, V], [R, dim], [B]
        logits, hidden = logits.unsqueeze(1), hidden.unsqueeze(1)  # [B, 1, V], [R, 1, dim]
        slots = root_slot.unsqueeze(-1) + torch.arange(self.depth + 1, device=root_slot.device)  # [B, D+1]
        positions = slots + self._offset(1)  # [B, D+1]
        drafts, log_probs = [], []  # D of [B, 1] each
        for d in range(self.depth):
            if d:  # draft d - 1 with its parent's output feature (the predicted feature before it)
                logits = runner.forward(drafts[-1], positions[:, d:d + 1], slots[:, d:d + 1], features=hidden)
                hidden = self.model.last_hidden  # [R, 1, dim]
            log_prob, token = self.log_probs(logits, slots[:, d + 1]).max(-1)  # [B, 1] each; child index root + 1 + d
            drafts.append(token)
            log_probs.append(log_prob)
        scores = torch.cat(log_probs, 1).cumsum(-1)  # [B, D] cumulative draft log-probs
        scores = torch.nn.functional.pad(scores, (1, 0))  # [B, D+1] the root's 0 first
        return chain_as_tree(torch.cat(drafts, 1), state.last_token, scores=scores)

    def observe(self, state: DecodeState, draft: DraftTree, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        runner = self.runner
        runner.commit_chain(self.pending.count * active)  # the pending pairs ran with true target features
        rows = runner.cache.batch_size
        verify = self.target_features(rows, draft.num_nodes, "verify forward")  # [R, N, dim]
        path = result.accepted_nodes[:, : self.width]  # [B, <=W] root first, -1 padded
        features = gather_nodes(verify, runner.rows(path))  # [R, <=W, dim] H[u_0], .., H[u_k]
        tokens = result.output_tokens[:, : self.width]  # [B, <=W] tok(u_1), .., tok(u_k), y
        count = result.num_accepted + 1  # [B] pairs pending per row
        self.pending.set_pairs(tokens, count, active, features, runner.rows(active))
        self.pending_columns = self.depth + 1  # the drafted depth bounds every row's accepted path
        if runner.cache.device.type == "cpu" and not has_compiled_forward(self.model):
            # on a CPU the longest accepted path is a free host read: the next `run_pending` runs that many columns,
            # not the drafted depth's (a chain of 16 that kept 12 ran 17 columns: at batch 8, 2.0 ms where 13 take 1.6)
            self.pending_columns = max(1, int((count * active).max()))

    def skip(self, state: DecodeState, result: VerifyResult, active: torch.Tensor,
             target_probs: torch.Tensor) -> None:
        """A plain step (no drafts): the target's token y pends with the feature that predicted it (the verify
        forward's only position)."""
        runner = self.runner
        feature = self.target_features(runner.cache.batch_size, 1, "plain step")[:, 0]  # [R, dim] H[root]
        self.room_for_plain_token(active)
        self.pending.append(result.final_tokens, active, feature, runner.rows(active))
