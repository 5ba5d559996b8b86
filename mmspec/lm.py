"""Loop adapters for causal LMs with a static KV cache: a target, a draft-model drafter, a tree drafter.

Any model that implements `CachedLM` (a `new_cache` and a `forward_cached` that scores several positions at
given cache slots under a given mask) can be a target (`LMTarget`) or a drafter (`DraftModelDrafter`: classic
chain drafting with a small model; `TreeModelDrafter`: EAGLE-2 dynamic trees scored by the model). `NoDrafter`
turns the loop into vanilla decoding. Image and VLM pipelines wrap their models in the same protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mmspec.cache import StaticKVCache
from mmspec.errors import check, check_positive_int
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams, probs_from_params, sample
from mmspec.tree import DraftTree, expand_eagle2
from mmspec.verify import ChainDraft, Draft, VerifyResult


class CachedLM(Protocol):
    vocab_size: int

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        """An empty cache for `batch_size` rows of up to `capacity` entries."""

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens, positions, slots [B, S]; mask [B, S, T]. Writes K/V at `slots`; returns logits [B, S, V]."""


def run_prompt(model: CachedLM, prompt: torch.Tensor, capacity: int) -> tuple[StaticKVCache, torch.Tensor]:
    """Prefill a fresh cache with prompt [B, P] (all committed); return (cache, logits of the last position)."""
    check(prompt.dim() == 2 and prompt.shape[1] >= 1, f"prompt must be [B, P] with P >= 1, got {list(prompt.shape)}.")
    cache = model.new_cache(prompt.shape[0], capacity)
    slots = cache.slots(prompt.shape[1])
    logits = model.forward_cached(prompt, slots, cache, slots, cache.attention_mask(slots))
    cache.commit_chain(torch.full_like(cache.lengths, prompt.shape[1]))
    return cache, logits[:, -1:]


class LMTarget:
    """A CachedLM as the loop's target; p is the model's distribution under `params` (temperature, top-k/p)."""

    def __init__(self, model: CachedLM, params: SamplingParams, max_new_tokens: int, max_draft_nodes: int = 64):
        self.model = model
        self.params = params
        self.extra_capacity = max_new_tokens + max_draft_nodes + 1
        self.cache: StaticKVCache | None = None

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        self.cache, logits = run_prompt(self.model, prompt, prompt.shape[1] + self.extra_capacity)
        return probs_from_params(logits, self.params)  # [B, 1, V]

    def verify(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        cache = self.cache
        if isinstance(draft, DraftTree):
            tokens = draft.tokens.clamp_min(0)  # [B, N], node 0 = state.last_token
            slots = cache.slots(tokens.shape[1])
            positions = draft.position_ids(cache.lengths)
            mask = cache.attention_mask(slots, draft.attention_mask())
        else:
            tokens = torch.cat([state.last_token.unsqueeze(-1), draft.tokens.clamp_min(0)], dim=1)  # [B, K+1]
            slots = cache.slots(tokens.shape[1])
            positions, mask = slots, cache.attention_mask(slots)
        logits = self.model.forward_cached(tokens, positions, cache, slots, mask)
        return probs_from_params(logits, self.params)

    def commit(self, state: DecodeState, draft: Draft, result: VerifyResult, active: torch.Tensor) -> None:
        keep = (result.num_accepted + 1) * active  # the last token plus the accepted drafts
        if isinstance(draft, DraftTree):
            self.cache.commit_path(result.accepted_nodes, keep)
        else:
            self.cache.commit_chain(keep)


class NoDrafter:
    """Proposes nothing: the loop becomes vanilla decoding (one target forward per token)."""

    forwards = 0

    def begin(self, inputs, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> ChainDraft:
        return ChainDraft(torch.empty(state.batch_size, 0, dtype=torch.long, device=state.done.device))

    def observe(self, state, draft, result, active) -> None:
        pass


class _PendingTokens:
    """Tokens the drafter has not run yet (ragged per row), fed at the start of the next proposal."""

    def __init__(self, batch_size: int, width: int, device: torch.device):
        self.tokens = torch.zeros(batch_size, width, dtype=torch.long, device=device)  # [B, W]
        self.count = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]

    def set(self, tokens: torch.Tensor, count: torch.Tensor, rows: torch.Tensor) -> None:
        """For rows [B] bool, replace the pending tokens with tokens [B, <=W] (first `count` used)."""
        padded = torch.zeros_like(self.tokens)
        padded[:, : tokens.shape[1]] = tokens.clamp_min(0)
        self.tokens = torch.where(rows.unsqueeze(-1), padded, self.tokens)
        self.count = torch.where(rows, count, self.count)


def feed_pending(model: CachedLM, cache: StaticKVCache, pending: _PendingTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """Run each row's pending tokens after its committed prefix (not committed). Returns (logits after the last
    pending token [B, V], the slot of that token [B])."""
    slots = cache.slots(pending.tokens.shape[1])  # [B, W]; entries past a row's count are scratch
    logits = model.forward_cached(pending.tokens, slots, cache, slots, cache.attention_mask(slots))
    last = (pending.count - 1).clamp_min(0)
    rows = torch.arange(slots.shape[0], device=slots.device)
    return logits[rows, last], slots[rows, last]


class DraftModelDrafter:
    """Classic speculative decoding: a (small) CachedLM drafts K tokens autoregressively.

    `params` is the drafter's own sampling setting; greedy drafters report no distribution (one-hot q).
    """

    def __init__(self, model: CachedLM, num_draft_tokens: int, params: SamplingParams, generator=None):
        check_positive_int("num_draft_tokens", num_draft_tokens)
        self.model, self.k, self.params, self.generator = model, num_draft_tokens, params, generator
        self.forwards = 0

    def begin(self, prompt: torch.Tensor, state: DecodeState) -> None:
        capacity = prompt.shape[1] + state.max_new_tokens + self.k + 2
        self.cache, _ = run_prompt(self.model, prompt, capacity)
        self.forwards += 1
        self.pending = _PendingTokens(state.batch_size, 2, prompt.device)
        self.pending.set(state.last_token.unsqueeze(-1), torch.ones_like(state.num_generated),
                         torch.ones_like(state.done))

    def propose(self, state: DecodeState) -> ChainDraft:
        logits, slot = feed_pending(self.model, self.cache, self.pending)  # [B, V], [B]
        self.forwards += 1
        tokens, probs = [], []
        for i in range(self.k):
            p = probs_from_params(logits, self.params)  # [B, V] the drafter's q
            x = logits.argmax(-1) if self.params.greedy else sample(p, self.generator)
            tokens.append(x)
            probs.append(p)
            if i + 1 < self.k:
                s = (slot + 1 + i).unsqueeze(-1)  # [B, 1]
                logits = self.model.forward_cached(x.unsqueeze(-1), s, self.cache, s,
                                                   self.cache.attention_mask(s))[:, 0]
                self.forwards += 1
        q = None if self.params.greedy else torch.stack(probs, 1)
        return ChainDraft(torch.stack(tokens, 1), q)

    def observe(self, state: DecodeState, draft: ChainDraft, result: VerifyResult, active: torch.Tensor) -> None:
        # the drafter ran the pending tokens and drafts x_1..x_{K-1}; keep what the target committed
        n = result.num_accepted
        self.cache.commit_chain((self.pending.count + n.clamp_max(self.k - 1)) * active)
        all_accepted = n == self.k
        last_draft = draft.tokens[:, -1]
        two = torch.stack([last_draft, result.final_tokens], 1)
        one = torch.stack([result.final_tokens, result.final_tokens], 1)
        self.pending.set(torch.where(all_accepted.unsqueeze(-1), two, one), 1 + all_accepted.long(), active)


class TreeModelDrafter:
    """EAGLE-2 dynamic draft trees scored by a CachedLM (deterministic top-k children).

    Each level runs the model once on the frontier, with tree attention over the candidate pool.
    """

    def __init__(self, model: CachedLM, top_k: int = 4, depth: int = 4, total_tokens: int = 16):
        self.model, self.top_k, self.depth, self.total = model, top_k, depth, total_tokens
        self.max_pool = 1 + top_k + (depth - 1) * top_k * top_k
        self.forwards = 0

    def begin(self, prompt: torch.Tensor, state: DecodeState) -> None:
        capacity = prompt.shape[1] + state.max_new_tokens + self.depth + 2 + self.max_pool
        self.cache, _ = run_prompt(self.model, prompt, capacity)
        self.forwards += 1
        self.pending = _PendingTokens(state.batch_size, self.depth + 1, prompt.device)
        self.pending.set(state.last_token.unsqueeze(-1), torch.ones_like(state.num_generated),
                         torch.ones_like(state.done))

    def propose(self, state: DecodeState) -> DraftTree:
        cache = self.cache
        root_logits, root_slot = feed_pending(self.model, cache, self.pending)  # [B, V], [B]
        self.forwards += 1
        b = state.batch_size
        device = root_slot.device
        keys = torch.arange(cache.capacity, device=device)
        # pool node j lives at slot root_slot + j; ancestors[b, j, i]: pool node i is j or an ancestor of j
        ancestors = torch.zeros(b, self.max_pool, self.max_pool, dtype=torch.bool, device=device)
        ancestors[:, 0, 0] = True

        def score(tokens, ids, parent_ids, depth):
            if depth == 0:
                return torch.log_softmax(root_logits.float(), -1).unsqueeze(1)  # [B, 1, V]
            rows = torch.arange(b, device=device).unsqueeze(-1)
            anc = ancestors[rows, parent_ids.clamp_min(0)]  # [B, F, P]
            anc[rows, torch.arange(ids.shape[1], device=device).unsqueeze(0), ids] = True
            ancestors[rows, ids] = anc
            slots = root_slot.unsqueeze(-1) + ids  # [B, F]
            offset = keys - root_slot.unsqueeze(-1)  # [B, T] pool index of each key
            in_pool = (offset >= 0) & (offset < self.max_pool)
            pool_cols = anc.gather(2, offset.clamp(0, self.max_pool - 1).unsqueeze(1).expand(-1, ids.shape[1], -1))
            mask = (keys < root_slot.unsqueeze(-1)).unsqueeze(1) | (in_pool.unsqueeze(1) & pool_cols)  # [B, F, T]
            logits = self.model.forward_cached(tokens, root_slot.unsqueeze(-1) + depth, cache, slots, mask)
            self.forwards += 1
            return torch.log_softmax(logits.float(), -1)

        return expand_eagle2(state.last_token, score, top_k=self.top_k, depth=self.depth, total_tokens=self.total)

    def observe(self, state: DecodeState, draft: DraftTree, result: VerifyResult, active: torch.Tensor) -> None:
        # keep only the pending tokens (they end with the root); the accepted path and the final token are run
        # again next time, as EAGLE re-runs its drafter on accepted tokens
        self.cache.commit_chain(self.pending.count * active)
        emitted = result.output_tokens[:, : self.depth + 1]  # accepted drafts then the final token
        self.pending.set(emitted, result.num_accepted + 1, active)

