"""EagleVLM: the EAGLE feature drafter over a LLaVA target's full sequence (SpecVLM's baseline), and its loop
drafter (EAGLE-2 dynamic trees, `mmspec.feature_drafter.FeatureTreeDrafter`).

The model (`VLMEagleDrafter`, from the facts of EAGLE's `cnets.py` and SpecVLM's EagleVLM):

    x_i = fc([e_i ; f_{i-1}])        # [B, S, 2H] -> [B, S, H]; fc has a bias
    h_i = one Llama decoder layer(x_i) at the target's position i (RoPE as the target's text model)
    logits_i = lm_head(h_i)          # the target's frozen head, no final norm (EAGLE)

e_i is the target's INPUT embedding at position i: the token embedding for text, the projected image feature
for an image position (EagleVLM drafts over the full multimodal sequence), and f_{i-1} the target's final
normed hidden state at the previous position (`CachedVLM.last_hidden`), the one that predicts token i.
h_i regresses f_i. Elements marked `direct` skip fc and enter the layer as e_i itself (MSD's image positions,
ViSpec's compressed image tokens). The decoder layer is a transformers `LlamaDecoderLayer`; `input_norm=False`
(the default) is EAGLE's layer 0 without its input RMSNorm, as EAGLE, ViSpec and MSD ship it; `input_norm=True`
keeps it (SpecVLM's EagleVLM added it to stabilise training). The embeddings and the head are the target's,
shared by `attach` (never saved). An official EAGLE-format checkpoint loads with `vlm.convert.load_official_drafter`.

Sequence layout: drafter element j sits at cache slot j and position j + 1 (the pair (f_j, e_{j+1})); EAGLE's code
puts that pair at position j, a constant shift that RoPE's relative attention does not see. After the
target's prefill of a prompt of P_b tokens, `begin` runs the prompt's P_b - 1 pairs at slots 0..P_b - 2 (rows
ragged, each commits its own count) and the first pending pair is (f_{P_b - 1}, first generated token).

Tree sizes: `depth` here is the number of drafted levels (the longest run one step can accept). EAGLE's code
counts a root expansion plus `depth` more levels, so its depth D is depth D + 1 here. Each drafter class carries
its paper's tree in this convention (`official_tree` = (depth, top_k, total_tokens)), the loop drafter's default.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.errors import check
from mmspec.feature_drafter import FeatureTreeDrafter, PendingPairs
from mmspec.llama_drafter import LlamaFeatureDrafter, llama_drafter_config
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams
from mmspec.tree import levels_of_eagle_depth
from vlm.target import CachedVLM, VLMInputs

# SpecVLM's EagleVLM tree: EAGLE's depth 7 (8 draft levels), top_k 10, total 60
SPECVLM_TREE = (levels_of_eagle_depth(7), 10, 60)


class VLMEagleDrafter(LlamaFeatureDrafter):
    """EAGLE feature drafter over a LLaVA target (see the module docstring; the model is
    `mmspec.llama_drafter.LlamaFeatureDrafter`). `for_target(lm)` builds one shaped like the target's text model;
    a loaded one must be `attach`ed to the target before use."""

    official_tree = SPECVLM_TREE  # (depth in levels, top_k, total_tokens): SpecVLM's setting for its EagleVLM

    def image_tokens_attended(self, num_image_tokens: int) -> float:
        """How many image tokens this drafter attends to per row (its prefill cost): all of them."""
        return num_image_tokens

    @classmethod
    def for_target(cls, target: CachedVLM, **overrides: Any) -> VLMEagleDrafter:
        """A fresh drafter shaped like the target's text model, attached to it."""
        drafter = cls(**{**llama_drafter_config(target.model.config.text_config), **overrides})
        return drafter.placed_like(target.model.lm_head.weight).attach(target)

    def attach(self, target: CachedVLM) -> VLMEagleDrafter:
        """Share the target's token embeddings and LM head (plain attributes: not saved); returns self."""
        check(isinstance(target, CachedVLM),
              f"attach needs a VLM target (vlm.target.cached_vlm), got {type(target).__name__}.")
        c = target.model.config.text_config
        return self.bind(target, {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size},
                         "train one for this target with `mmspec train vlm-drafter`")

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on drafter features [..., H] -> float32 logits [..., V]."""
        return self.target.model.lm_head(hidden).float()


# ---------------------------------------------------------------------------------------------- loop drafter
def official_tree_filled(drafter: VLMEagleDrafter, depth: int | None, top_k: int | None,
                         total_tokens: int | None) -> tuple[int, int, int]:
    """(depth, top_k, total_tokens) with the ones left None taken from the drafter's `official_tree`."""
    given = (depth, top_k, total_tokens)
    return tuple(value if value is not None else default for value, default in zip(given, drafter.official_tree))


class VLMEagleTreeDrafter(FeatureTreeDrafter):
    """EAGLE-2 dynamic trees from a `VLMEagleDrafter` over a `CachedVLM` target (drafter element j at
    position j + 1). `begin` runs the prompt's pairs from the target's prefill (its merged input embeddings and
    features), ragged per row. Tree sizes left None take the drafter's `official_tree`; children are ranked by
    the drafter's raw log-softmax (EAGLE's code) unless child_ranking="processed"."""

    def __init__(self, drafter: VLMEagleDrafter, target: CachedVLM, params: SamplingParams, *,
                 top_k: int | None = None, depth: int | None = None, total_tokens: int | None = None,
                 child_ranking: str = "raw"):
        depth, top_k, total_tokens = official_tree_filled(drafter, depth, top_k, total_tokens)
        super().__init__(drafter.attach(target), target, params, top_k=top_k, depth=depth,
                         total_tokens=total_tokens, position_offset=1, child_ranking=child_ranking)
        self.drafter = drafter

    def prompt_inputs(self, inputs: VLMInputs) -> dict:
        """Extra `forward_cached` inputs of the prompt's pairs (none for EagleVLM; MSD's direct image mask)."""
        return {}

    def begin(self, inputs: VLMInputs, state: DecodeState) -> None:
        target = self.target
        lengths = inputs.lengths.to(state.done.device)  # [B]
        b, p = inputs.input_ids.shape
        features = self.target_features(b, p, "prefill")  # [B, P, H]
        embeds = target.prompt_embeds  # [B, P, H]
        check(embeds is not None and embeds.shape[:2] == (b, p), "run the target's prefill (prefill_vlm) first.")
        cache = self.new_drafter_cache(b, p + state.max_new_tokens + self.width)
        if p > 1:  # the prompt's pairs (f_j, e_{j+1}), j < P_b - 1
            slots = cache.slots(p - 1)  # [B, P-1]
            self.runner.forward(None, slots + 1, slots, features=features[:, :-1], embeds=embeds[:, 1:],
                                logits=False, **self.prompt_inputs(inputs))  # fills the cache: K/V alone, no logits
            self.runner.commit_chain(lengths - 1)
        self.pend_first_pair(state, features, lengths)

    def run_prompt_layout(self, state: DecodeState, positions: torch.Tensor, keep: torch.Tensor,
                          **pairs: torch.Tensor) -> None:
        """A compressed prompt layout (ViSpec, SpecVLM) into a new drafter cache: its elements at positions [B, L']
        (`pairs`: features, embeds, and `forward_cached`'s other inputs), the first keep [B] of each row committed.
        logits=False: the prompt pass only fills the cache (no head, the layer run to its K/V alone)."""
        b, width = positions.shape
        cache = self.new_drafter_cache(b, width + state.max_new_tokens + self.width)
        slots = cache.slots(width)  # [B, L']
        self.drafter.forward_cached(None, positions, cache, slots, cache.attention_mask(slots), logits=False, **pairs)
        self.runner.forwards += 1
        self.runner.commit_chain(keep)

    def pend_first_pair(self, state: DecodeState, features: torch.Tensor, lengths: torch.Tensor) -> None:
        """The first decode pair pends: the first token with the target's feature at each row's last prompt
        position (features [B, P, H], lengths [B])."""
        last = (lengths - 1).view(-1, 1, 1).expand(-1, -1, features.shape[-1])
        self.pending = PendingPairs(state.last_token, features.gather(1, last)[:, 0], self.width)


VLMEagleDrafter.loop_drafter = VLMEagleTreeDrafter  # what the loop runs for this drafter model
