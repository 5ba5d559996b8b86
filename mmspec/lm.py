"""Loop adapters for causal LMs with a static KV cache: a target, a draft-model drafter, a tree drafter.

Any model that implements `CachedLM` (a `new_cache` and a `forward_cached` that scores several positions at
given cache slots under a given mask) can be a target (`LMTarget`) or a drafter (`DraftModelDrafter`: classic
chain drafting with a small model; `TreeModelDrafter`: EAGLE-2 dynamic trees scored by the model). `NoDrafter`
turns the loop into vanilla decoding. Image and VLM pipelines wrap their models in the same protocol.
`CandidatePool` is the tree attention over EAGLE-2's candidate pool in a drafter's cache, shared by
`TreeModelDrafter` and feature-level (EAGLE) drafters.

`GuidedRunner` holds a model and its cache and does classifier-free guidance the LlamaGen way when asked: the
cache holds 2B rows [conditional ; unconditional], every token goes to both halves, and the logits returned are
`uncond + scale * (cond - uncond)`. The unconditional prompts may be shorter or longer than the conditional ones
(a negative prompt, Emu3's one-token context): each half's tokens then sit at its own rows' slots and positions.
Targets and drafters use it, so CFG lives in one place.

`TokenLayout` is a constraint on which tokens each generated-token index may take (an image's row ends, its end
tokens: what transformers' `prefix_allowed_tokens_fn` does for Emu3); `LMTarget` applies it to every p it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmspec.cache import StaticKVCache
from mmspec.compile import has_compiled_forward
from mmspec.errors import check, check_positive_int
from mmspec.loop import DecodeState, plain_draft
from mmspec.prefixes import PrefixLogits
from mmspec.sampling import SamplingParams, cfg_combine, probs_from_params, race, split_cfg_batch
from mmspec.tree import DraftTree, SteeredTree, TreeShape, expand_eagle2, max_chain_depth, pool_size
from mmspec.verify import ChainDraft, Draft, VerifyResult


class CachedLM(Protocol):
    vocab_size: int

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        """An empty cache for `batch_size` rows of up to `capacity` entries."""

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens, positions, slots [B, S]; mask [B, S, T]. Writes K/V at `slots`; returns logits [B, S, V].
        A model with `attends_without_mask = True` also takes mask None: every query sees every key of the cache's
        visible range (`GuidedRunner.forward` passes None for one query per row, all rows at that range's last slot,
        on a CPU: the mask's 7 operations are most of what a tiny drafter's step costs beyond its matrix products)."""


def prefill_prompt(model: CachedLM, prompt: torch.Tensor, extra_capacity: int) -> tuple[StaticKVCache, torch.Tensor]:
    """Prefill a fresh cache with a token prompt [R, P] (all committed), leaving room for `extra_capacity` more
    entries; return (cache, logits for the first new token [R, 1, V])."""
    check(isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[1] >= 1,
          f"prompt must be a [B, P] token tensor with P >= 1, got {getattr(prompt, 'shape', type(prompt))}.")
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + extra_capacity)
    slots = cache.slots(prompt.shape[1])
    logits = model.forward_cached(prompt, slots, cache, slots, cache.attention_mask(slots))
    cache.commit_chain(torch.full_like(cache.lengths, prompt.shape[1]))
    return cache, logits[:, -1:]


def cfg_prompt_pair(model: CachedLM, prompts: tuple[torch.Tensor, torch.Tensor],
                    extra_capacity: int) -> tuple[StaticKVCache, torch.Tensor]:
    """CFG prefill for token prompts: `(cond [B, P], uncond [B, P])` become the 2B rows [cond ; uncond]."""
    return prefill_prompt(model, torch.cat(prompts, dim=0), extra_capacity)


# prefill_fn(model, inputs, extra_capacity) -> (committed cache, logits for the first new token [R, 1, V])
PrefillFn = Callable[[CachedLM, Any, int], tuple[StaticKVCache, torch.Tensor]]


def hidden_at(hidden: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """hidden [B, S, H] at one position per row, index [B] -> [B, 1, H] (None: all of it). A prefill scores only each
    row's last prompt position, as transformers' `generate` does (`logits_to_keep=1`): the head over every prompt
    position costs P x V x H (a 600-token VLM prompt with a 152k vocabulary: 82 GFLOP and 365 MB a row)."""
    if index is None:
        return hidden
    return hidden.gather(1, index.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))


def both_halves(t: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [2B, ...]: the same tensor for the conditional and the unconditional rows of a CFG batch."""
    return torch.cat([t, t], dim=0)


class GuidedRunner:
    """A CachedLM with its cache, optionally run as a CFG pair. All arguments and results have B rows."""

    def __init__(self, model: CachedLM, guidance_scale: float | torch.Tensor | None = None,
                 prefill_fn: PrefillFn = prefill_prompt):
        self.model = model
        self.guidance_scale = guidance_scale
        self.prefill_fn = prefill_fn
        self.cache: StaticKVCache | None = None
        self.uncond_shift: torch.Tensor | None = None  # [B] uncond prompt length - cond prompt length (CFG)
        self.forwards = 0

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale is not None

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return both_halves(t) if self.uses_cfg else t

    def row_slots(self, t: torch.Tensor) -> torch.Tensor:
        """Slots or positions [B, S] of the conditional rows -> [R, S]: the unconditional rows' own (shifted by
        their prompts' length difference)."""
        if not self.uses_cfg or self.uncond_shift is None:  # no shift known (a cache set up by its owner): equal
            return self.rows(t)
        return torch.cat([t, t + self.uncond_shift.view(-1, *([1] * (t.dim() - 1)))], dim=0)

    def combine(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, ...] model logits -> [B, ...] (CFG-combined when guided)."""
        if not self.uses_cfg:
            return logits
        cond, uncond = split_cfg_batch(logits)
        scale = self.guidance_scale
        if isinstance(scale, torch.Tensor):  # per-row scales [B]
            scale = scale.to(logits.device).view(-1, *([1] * (logits.dim() - 1)))
        return cfg_combine(cond, uncond, scale)

    def model_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Row indices rows [B'] of the current B -> the model's [R'] (both halves of a CFG pair)."""
        return torch.cat([rows, rows + self.cache.batch_size // 2]) if self.uses_cfg else rows

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows [B'] (indices into the current B, in that order): the cache's rows (both halves of a CFG
        pair), the unconditional rows' shift and per-row guidance scales (`mmspec.loop`'s finished-row dropping)."""
        both = self.model_rows(rows)  # [R']
        if self.uses_cfg and isinstance(self.guidance_scale, torch.Tensor) and self.guidance_scale.dim() > 0:
            self.guidance_scale = self.guidance_scale.index_select(0, rows.to(self.guidance_scale.device))  # [B']
        self.cache.select_rows(both)
        if self.uncond_shift is not None:
            self.uncond_shift = self.uncond_shift.index_select(0, rows)
        if hasattr(self.model, "select_rows"):  # a model's own per-row state of the call (Qwen2-VL's rope deltas)
            self.model.select_rows(both)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] committed entries per row."""
        return self.cache.lengths[: self.cache.batch_size // (2 if self.uses_cfg else 1)]

    def prefill(self, inputs: Any, extra_capacity: int) -> torch.Tensor:
        self.cache, logits = self.prefill_fn(self.model, inputs, extra_capacity)
        if self.uses_cfg:
            b = self.cache.batch_size // 2
            self.uncond_shift = self.cache.lengths[b:] - self.cache.lengths[:b]  # [B], zeros for equal prompts
        self.forwards += 1
        return self.combine(logits)  # [B, 1, V]

    def slots(self, num_new: int) -> torch.Tensor:
        """[B, S] slots for S new entries per row (one entry: a view of the lengths, never written in place)."""
        if num_new == 1:
            return self.lengths.unsqueeze(-1)
        return self.lengths.unsqueeze(-1) + torch.arange(num_new, device=self.cache.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                tree_mask: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                **model_inputs: Any) -> torch.Tensor | None:
        """Run tokens [B, S] at positions/slots [B, S] (not committed). The mask is causal over the new entries,
        or `tree_mask` [B, S, S] over them, or a full `mask` [B, S, T]. Returns combined logits [B, S, V] (None
        when `model_inputs` ask a drafter for none: `logits=False`, a prompt pass that only fills the cache).

        `model_inputs` go to `forward_cached` unchanged, so they must already have the model's R rows (2B with
        CFG), e.g. the target features of an EAGLE drafter, which differ between the two halves."""
        positions = self.row_slots(positions)  # [R, S]
        max_positions = getattr(self.model, "max_seq_len", None)
        if max_positions is not None:  # padding entries past the end (their outputs are never used)
            positions = positions.clamp_max(max_positions - 1)
        full_slots = self.row_slots(slots)  # [R, S]
        cache = self.cache
        # on a CPU, attend over the slots up to this step's last one, not the whole capacity (one cheap host read;
        # on an accelerator the read would be a sync per forward, and a compiled forward wants static shapes)
        eager_cpu = cache.device.type == "cpu" and not has_compiled_forward(self.model)
        unmasked = False
        if eager_cpu and full_slots.shape[1] == 1 and mask is None and tree_mask is None:
            last = full_slots.view(-1).tolist()  # one query per row: its slot, read without a device operation
            limit = max(last) + 1
            unmasked = min(last) + 1 == limit and getattr(self.model, "attends_without_mask", False)
        elif eager_cpu:  # the slots read once: their bound, and whether every row writes the same slots
            slot_rows = full_slots.tolist()
            limit = max(map(max, slot_rows)) + 1
            if len(slot_rows) > 1 and all(row == slot_rows[0] for row in slot_rows):  # (batch 1 with CFG): one
                full_slots = full_slots[:1].expand_as(full_slots)  # index_copy_ per layer, not a scatter (cache.write)
        else:
            limit = cache.capacity
        with cache.keys_up_to(limit):
            if mask is not None:
                mask = self.rows(mask)[..., :limit]
            elif not unmasked:  # (unmasked: every row's one query at the same slot sees every key up to it)
                mask = cache.attention_mask(full_slots, None if tree_mask is None else self.rows(tree_mask))
            logits = self.model.forward_cached(self.rows(tokens), positions, cache, full_slots, mask, **model_inputs)
        self.forwards += 1
        return None if logits is None else self.combine(logits)  # (None: a model asked for no logits)

    def commit_chain(self, keep: torch.Tensor) -> None:
        self.cache.commit_chain(self.rows(keep))

    def commit_path(self, path: torch.Tensor, keep: torch.Tensor) -> None:
        self.cache.commit_path(self.rows(path), self.rows(keep))


@torch.no_grad()
def teacher_forced_probs(runner: GuidedRunner, inputs: Any, tokens: torch.Tensor,
                         params: SamplingParams, layout: TokenLayout | None = None) -> torch.Tensor:
    """The distributions [B, T, V] decoding samples each of the finished `tokens` [B, T] from: p[:, t] given
    `inputs` (the prompt or condition the runner's prefill takes) and tokens[:, :t], under `params` (and the
    runner's CFG). One prefill and one forward over the sequence, positions = cache slots as in decoding; used to
    test how closely a method's tokens follow the target (`mmspec.metrics.calibration`)."""
    check(tokens.dim() == 2 and tokens.shape[1] >= 1, f"tokens must be [B, T], got {tuple(tokens.shape)}.")
    logits = [runner.prefill(inputs, extra_capacity=tokens.shape[1])]  # [B, 1, V]
    if tokens.shape[1] > 1:
        slots = runner.slots(tokens.shape[1] - 1)  # [B, T-1]
        logits.append(runner.forward(tokens[:, :-1], slots, slots))  # [B, T-1, V]
    logits = torch.cat(logits, dim=1)  # [B, T, V]
    if layout is not None:  # generated-token index t at column t
        logits = layout.constrain(logits, torch.arange(logits.shape[1], device=logits.device).expand(logits.shape[:2]))
    return probs_from_params(logits, params)  # [B, T, V]


# draft entries (chain drafts, window positions or tree nodes) an LMTarget's cache keeps room for by default
DRAFT_ROOM = 64


def room_for_drafts(drafter: Any) -> int:
    """The cache room an LMTarget keeps for `drafter`'s largest verify: its `max_draft_nodes` (a tree's node budget, a
    Jacobi window), at least DRAFT_ROOM."""
    return max(DRAFT_ROOM, int(getattr(drafter, "max_draft_nodes", 0)))


@dataclass(frozen=True)
class TokenLayout:
    """Which tokens each generated-token index may take: index t is of kind kinds[t] (an index past the end takes
    the last kind) and a kind allows the tokens allowed[kind]; every other token's logit becomes -inf, before the
    sampling settings (as transformers' `PrefixConstrainedLogitsProcessor` runs before its warpers)."""

    kinds: torch.Tensor  # [L] long
    allowed: torch.Tensor  # [K, V] bool

    def constrain(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """logits [B, S, V] of generated-token indices [B, S] -> the same with the disallowed tokens at -inf."""
        kinds = self.kinds[index.clamp(0, self.kinds.shape[0] - 1)]  # [B, S]
        return logits.masked_fill(~self.allowed[kinds], float("-inf"))


class LMTarget:
    """A CachedLM as the loop's target; p is the model's distribution under `params` (temperature, top-k/p).

    `guidance_scale` turns on classifier-free guidance (see `GuidedRunner`); `prefill_fn` runs the condition
    (default: a token prompt; `cfg_prompt_pair` for a (cond, uncond) pair of prompts); `layout` constrains the
    tokens of each generated-token index (after CFG, before the sampling settings).
    """

    def __init__(self, model: CachedLM, params: SamplingParams, max_new_tokens: int,
                 max_draft_nodes: int = DRAFT_ROOM, *, guidance_scale: float | torch.Tensor | None = None,
                 prefill_fn: PrefillFn = prefill_prompt, layout: TokenLayout | None = None):
        self.runner = GuidedRunner(model, guidance_scale, prefill_fn)
        self.params = params
        self.layout = layout
        self.extra_capacity = max_new_tokens + max_draft_nodes + 1
        self.plain_capacity = max_new_tokens + 2  # what a target without drafts keeps (max_draft_nodes = 1)
        # set by the loop before each prefill: False when the call drafts nothing (its budget's gate ran it without
        # the drafter), so the cache keeps no room for draft nodes (the world LLaVA at batch 32 on a 2-core CPU,
        # 2026-11-28: such calls ran 2.7-3.8% slower than vanilla's with a tree's room, 0.5-0.9% faster without)
        self.draft_room = True
        # set by the loop from the rule: at temperature 0, p is the softmax of the logits instead of the one-hot
        # argmax (`mmspec.sampling.probs_from_params`), for a relaxed greedy rule (`greedy_reads_softmax`)
        self.soft_greedy = False
        # per-prefix processing of the logits before `params` (`mmspec.prefixes.PrefixLogits`: transformers' logits
        # processors on each verified entry's own prefix), or None
        self.logits_hook: PrefixLogits | None = None

    def prefill(self, inputs: Any) -> torch.Tensor:
        room = self.extra_capacity if self.draft_room else self.plain_capacity
        logits = self.runner.prefill(inputs, room)  # [B, 1, V]
        if self.layout is not None:
            logits = self.layout.constrain(logits, torch.zeros(logits.shape[:2], dtype=torch.long,
                                                               device=logits.device))
        if self.logits_hook is not None:  # (no token generated yet: each row's prefix is its prompt)
            b, device = logits.shape[0], logits.device
            logits = self.logits_hook(logits, torch.empty(b, 0, dtype=torch.long, device=device),
                                      torch.zeros(b, dtype=torch.long, device=device), None, None)
        return probs_from_params(logits, self.params, self.soft_greedy)

    def verify(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        runner = self.runner
        if isinstance(draft, DraftTree):
            slots = runner.slots(draft.num_nodes)
            logits = runner.forward(draft.tokens.clamp_min(0), draft.position_ids(runner.lengths), slots,
                                    tree_mask=None if draft.is_chain else draft.attention_mask())
            offsets = draft.depths  # [B, N] a node predicts the token after it
        else:
            tokens = state.last_token.unsqueeze(-1)  # [B, 1]
            if draft.tokens.shape[1]:
                tokens = torch.cat([tokens, draft.tokens.clamp_min(0)], dim=1)  # [B, K+1]
            slots = runner.slots(tokens.shape[1])
            logits = runner.forward(tokens, slots, slots)
            offsets = None  # [B, K+1] 0..K, made only where a layout needs it
        if self.layout is not None:  # entry j predicts generated-token index num_generated + its offset
            if offsets is None:
                offsets = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            logits = self.layout.constrain(logits, state.num_generated.unsqueeze(-1) + offsets)
        if self.logits_hook is not None:
            logits = self.logits_hook(logits, state.tokens, state.num_generated, draft, state.row_ids)
        return probs_from_params(logits, self.params, self.soft_greedy)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows [B'] of the call (the loop drops finished rows)."""
        self.runner.select_rows(rows)

    def commit(self, state: DecodeState, draft: Draft, result: VerifyResult, active: torch.Tensor) -> None:
        keep = (result.num_accepted + 1) * active  # the last token plus the accepted drafts
        if isinstance(draft, DraftTree) and not draft.is_chain:  # a chain's accepted nodes are in place
            self.runner.commit_path(result.accepted_nodes, keep)
        else:
            self.runner.commit_chain(keep)


class NoDrafter:
    """Proposes nothing: the loop becomes vanilla decoding (one target forward per token)."""

    forwards = 0
    draft_sizes = (0,)
    _plain: ChainDraft | None = None  # the empty draft `propose` returns, made once per batch shape and device

    def begin(self, inputs, state: DecodeState) -> None:
        pass

    def set_draft_size(self, k: int) -> None:
        pass

    def skip(self, state, result, active, target_probs) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def propose(self, state: DecodeState) -> ChainDraft:
        draft = self._plain
        if draft is None or draft.tokens.shape[0] != state.batch_size or draft.tokens.device != state.done.device:
            draft = self._plain = plain_draft(state.batch_size, state.done.device)
        return draft

    def observe(self, state, draft, result, active, target_probs) -> None:
        pass


class PendingTokens:
    """Tokens the drafter has not run yet (ragged per row), fed at the start of the next proposal."""

    def __init__(self, last_token: torch.Tensor, width: int):
        b = last_token.shape[0]
        self.tokens = torch.zeros(b, width, dtype=torch.long, device=last_token.device)  # [B, W]
        self.tokens[:, 0] = last_token
        self.count = torch.ones(b, dtype=torch.long, device=last_token.device)  # [B]

    def set(self, tokens: torch.Tensor, count: torch.Tensor, rows: torch.Tensor) -> None:
        """For rows [B] bool, replace the pending tokens with tokens [B, <=W] (first `count` used)."""
        padded = torch.zeros_like(self.tokens)
        padded[:, : tokens.shape[1]] = tokens.clamp_min(0)
        self.tokens = torch.where(rows.unsqueeze(-1), padded, self.tokens)
        self.count = torch.where(rows, count, self.count)

    def next_column(self) -> torch.Tensor:
        """[B, W] bool: each row's first free column."""
        return torch.arange(self.tokens.shape[1], device=self.count.device) == self.count.unsqueeze(-1)

    def append(self, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """For rows [B] bool, add tokens [B] after the pending ones (a row must have room: count < W)."""
        self.tokens = torch.where(self.next_column() & rows.unsqueeze(-1), tokens.unsqueeze(-1), self.tokens)
        self.count = self.count + rows.long()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows [B'] (indices into the current B, in that order)."""
        self.tokens, self.count = self.tokens.index_select(0, rows), self.count.index_select(0, rows)


def feed_pending(runner: GuidedRunner, pending: PendingTokens,
                 columns: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run each row's pending tokens (the first `columns`, default all) after its committed prefix (not committed).
    Returns (logits after the last pending token [B, V], the slot of that token [B])."""
    columns = columns or pending.tokens.shape[1]
    slots = runner.slots(columns)  # [B, C]; entries past a row's count are scratch
    logits = runner.forward(pending.tokens[:, :columns], slots, slots)
    last = (pending.count - 1).clamp(0, columns - 1)  # finished rows may hold more than the bound: any column
    rows = torch.arange(slots.shape[0], device=slots.device)
    return logits[rows, last], slots[rows, last]


PLAIN_ROOM = 64  # pending tokens a drafter keeps for plain steps before it runs them


class PendingRoom:
    """Plain steps' tokens wait with a drafter's pending tokens instead of running its model every step. The drafter
    has `runner`, `pending` (a `PendingTokens`) and `run_pending()`, which runs the first `pending_columns` pending
    tokens (not committed); `pending_columns` is a host-side bound on every row's pending count (no device sync)."""

    pending_columns: int = 1

    def room_for_plain_token(self, active: torch.Tensor) -> None:
        """Before a plain step's token joins the pending tokens: when the room is full, run and commit the pending
        tokens of every active row, leaving none pending."""
        pending = self.pending
        if self.pending_columns >= pending.tokens.shape[1]:
            self.run_pending()
            self.runner.commit_chain(pending.count * active)
            pending.count = torch.where(active, 0, pending.count)
            self.pending_columns = 0
        self.pending_columns += 1


class ShapedTreeDrafter(PendingRoom, SteeredTree):
    """A tree drafter with its own model that a draft budget can steer (`SteeredTree`), with the pending tokens of
    plain steps (`PendingRoom`). The drafter has `top_k`, `depth`, `total`, `runner`, `pending` (room for
    `pending_width()` tokens) and `run_pending()`."""

    def pending_width(self) -> int:
        """Pending tokens a row can hold: the longest accepted path (the deepest chain) plus the final token, plus
        PLAIN_ROOM plain steps' tokens (run together at the next proposal, or when the room is full)."""
        return max_chain_depth(self.full_shape) + 1 + PLAIN_ROOM


class DraftModelDrafter(PendingRoom):
    """Classic speculative decoding: a (small) CachedLM drafts K tokens autoregressively.

    `params` is the drafter's own sampling setting; greedy drafters report no distribution (one-hot q). The
    drafter receives the same inputs as the target (`prefill_fn`, `guidance_scale` as in `LMTarget`). Its samples
    use the call's keyed noise (`state.noise.draft_exponentials`: draft i at token index g + i).
    """

    def __init__(self, model: CachedLM, num_draft_tokens: int, params: SamplingParams, *,
                 guidance_scale: float | torch.Tensor | None = None, prefill_fn: PrefillFn = prefill_prompt):
        check_positive_int("num_draft_tokens", num_draft_tokens)
        self.runner = GuidedRunner(model, guidance_scale, prefill_fn)
        self.k, self.params = num_draft_tokens, params
        self.max_k = num_draft_tokens

    @property
    def draft_sizes(self) -> range:
        """Draft counts a budget may ask for: 0 (a plain step) to num_draft_tokens."""
        return range(0, self.max_k + 1)

    def set_draft_size(self, k: int) -> None:
        check(0 < k <= self.max_k, f"draft size must be in [1, {self.max_k}], got {k}.")
        self.k = k

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def begin(self, inputs: Any, state: DecodeState) -> None:
        self.runner.prefill(inputs, state.max_new_tokens + self.max_k + 2 + PLAIN_ROOM)
        self.pending = PendingTokens(state.last_token, 2 + PLAIN_ROOM)  # a draft's last two tokens, plain steps'
        self.pending_columns = 1

    def propose(self, state: DecodeState) -> ChainDraft:
        logits, slot = self.run_pending()  # [B, V], [B]
        tokens, probs = [], []
        for i in range(self.k):
            p = probs_from_params(logits, self.params)  # [B, V] the drafter's q
            if self.params.greedy:
                x = logits.argmax(-1)
            else:  # draft i decides token index g + i
                index = (state.num_generated + i).unsqueeze(-1)  # [B, 1]
                x = race(p, state.noise.draft_exponentials(index, p.shape[-1], state.iteration)[:, 0])
            tokens.append(x)
            probs.append(p)
            if i + 1 < self.k:
                s = (slot + 1 + i).unsqueeze(-1)  # [B, 1]
                logits = self.runner.forward(x.unsqueeze(-1), s, s)[:, 0]
        q = None if self.params.greedy else torch.stack(probs, 1)
        return ChainDraft(torch.stack(tokens, 1), q)

    def observe(self, state: DecodeState, draft: ChainDraft, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        # the drafter ran the pending tokens and drafts x_1..x_{K-1}; keep what the target committed
        n, k = result.num_accepted, draft.tokens.shape[1]
        self.runner.commit_chain((self.pending.count + n.clamp_max(k - 1)) * active)
        all_accepted = n == k
        two = torch.stack([draft.tokens[:, -1], result.final_tokens], 1)
        one = torch.stack([result.final_tokens, result.final_tokens], 1)
        self.pending.set(torch.where(all_accepted.unsqueeze(-1), two, one), 1 + all_accepted.long(), active)
        self.pending_columns = 2

    def skip(self, state: DecodeState, result: VerifyResult, active: torch.Tensor,
             target_probs: torch.Tensor) -> None:
        """The loop made a plain step without drafts: the final token pends (run with the next proposal; when the
        room is full the pending tokens run and are kept first), so plain steps cost the drafter nothing."""
        self.room_for_plain_token(active)
        self.pending.append(result.final_tokens, active)

    def run_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the first `pending_columns` pending tokens (not committed): `feed_pending`'s logits and slot."""
        return feed_pending(self.runner, self.pending, self.pending_columns)


class CandidatePool:
    """EAGLE-2's candidate pool in a drafter's cache, with tree attention (used by `expand_eagle2` scorers).

    Pool node j (0 = the root, then every candidate in creation order, the ids `expand_eagle2` hands to its
    scorer) lives at cache slot `root_slot + j`. A candidate sees the committed prefix (slots below the root's)
    and its own ancestors in the pool, itself included; stale entries in the pool region stay hidden.
    """

    def __init__(self, root_slot: torch.Tensor, max_pool: int, capacity: int):
        b, device = root_slot.shape[0], root_slot.device
        self.root_slot = root_slot  # [B]
        self.max_pool = max_pool
        self.keys = torch.arange(capacity, device=device)  # [T]
        # ancestors[b, j, i]: pool node i is j or an ancestor of j
        self.ancestors = torch.zeros(b, max_pool, max_pool, dtype=torch.bool, device=device)  # [B, P, P]
        self.ancestors[:, 0, 0] = True
        self.batch_rows = torch.arange(b, device=device).unsqueeze(-1)  # [B, 1]

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, F] cache slots of pool nodes ids [B, F]."""
        return self.root_slot.unsqueeze(-1) + ids

    def mask(self, ids: torch.Tensor, parent_ids: torch.Tensor) -> torch.Tensor:
        """Register pool nodes ids [B, F] as children of parent_ids [B, F]; return their attention mask [B, F, T]."""
        rows = self.batch_rows
        anc = self.ancestors[rows, parent_ids.clamp_min(0)]  # [B, F, P]
        anc[rows, torch.arange(ids.shape[1], device=ids.device).unsqueeze(0), ids] = True
        self.ancestors[rows, ids] = anc
        offset = self.keys - self.root_slot.unsqueeze(-1)  # [B, T] pool index of each key
        in_pool = (offset >= 0) & (offset < self.max_pool)
        pool_cols = anc.gather(2, offset.clamp(0, self.max_pool - 1).unsqueeze(1).expand(-1, ids.shape[1], -1))
        prefix = self.keys < self.root_slot.unsqueeze(-1)  # [B, T]
        return prefix.unsqueeze(1) | (in_pool.unsqueeze(1) & pool_cols)  # [B, F, T]


class TreeModelDrafter(ShapedTreeDrafter):
    """EAGLE-2 dynamic draft trees scored by a CachedLM (deterministic top-k children).

    Each level runs the model once on the frontier, with tree attention over the candidate pool. A draft budget
    (`mmspec.budget`) may draft smaller shapes or plain steps.
    """

    def __init__(self, model: CachedLM, top_k: int = 4, depth: int = 4, total_tokens: int = 16, *,
                 guidance_scale: float | torch.Tensor | None = None, prefill_fn: PrefillFn = prefill_prompt):
        self.runner = GuidedRunner(model, guidance_scale, prefill_fn)
        self.top_k, self.depth, self.total = top_k, depth, total_tokens
        self.full_shape = TreeShape(top_k, depth, total_tokens)
        self.max_pool = pool_size(top_k, depth)
        self.width = self.pending_width()  # pending tokens: an accepted path + the final token, plain steps'

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def begin(self, inputs: Any, state: DecodeState) -> None:
        self.runner.prefill(inputs, state.max_new_tokens + self.width + 1 + self.max_pool)
        self.pending = PendingTokens(state.last_token, self.width)
        self.pending_columns = 1

    def run_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        return feed_pending(self.runner, self.pending, self.pending_columns)

    def propose(self, state: DecodeState) -> DraftTree:
        runner = self.runner
        root_logits, root_slot = self.run_pending()  # [B, V], [B]
        pool = CandidatePool(root_slot, self.max_pool, runner.cache.capacity)

        def score(tokens, ids, parent_ids, depth):
            if depth == 0:
                return torch.log_softmax(root_logits.float(), -1).unsqueeze(1)  # [B, 1, V]
            mask = pool.mask(ids, parent_ids)  # [B, F, T]
            logits = runner.forward(tokens, (root_slot + depth).unsqueeze(-1).expand_as(ids), pool.slots(ids),
                                    mask=mask)
            return torch.log_softmax(logits.float(), -1)

        return expand_eagle2(state.last_token, score, top_k=self.top_k, depth=self.depth, total_tokens=self.total)

    def observe(self, state: DecodeState, draft: DraftTree, result: VerifyResult, active: torch.Tensor,
                target_probs: torch.Tensor) -> None:
        # keep only the pending tokens (they end with the root); the accepted path and the final token are run
        # again next time, as EAGLE re-runs its drafter on accepted tokens
        self.runner.commit_chain(self.pending.count * active)
        emitted = result.output_tokens[:, : self.width]  # accepted drafts then the final token
        self.pending.set(emitted, result.num_accepted + 1, active)
        self.pending_columns = self.depth + 1  # the drafted depth bounds every row's accepted path

    def skip(self, state: DecodeState, result: VerifyResult, active: torch.Tensor,
             target_probs: torch.Tensor) -> None:
        """A plain step (no drafts): the target's token pends."""
        self.room_for_plain_token(active)
        self.pending.append(result.final_tokens, active)
