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
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mmspec.attention.model_backend import AttentionBackendMixin
from mmspec.cache import StaticKVCache
from mmspec.errors import InputError, check
from mmspec.feature_drafter import FeatureTreeDrafter, PendingPairs
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams
from vlm.draft_layers import run_llama_layers
from vlm.target import CachedVLM, VLMInputs

# SpecVLM's EagleVLM tree: EAGLE's depth 7 (8 levels here), top_k 10, total 60
SPECVLM_TREE = (8, 10, 60)


class VLMEagleDrafter(AttentionBackendMixin, ModelMixin, ConfigMixin):
    """EAGLE feature drafter over a LLaVA target (see the module docstring). `for_target(lm)` builds one shaped
    like the target's text model; a loaded one must be `attach`ed to the target before use."""

    official_tree = SPECVLM_TREE  # (depth in levels, top_k, total_tokens): SpecVLM's setting for its EagleVLM

    @register_to_config
    def __init__(self, hidden_size: int = 4096, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 intermediate_size: int = 11008, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 4096, vocab_size: int = 32064, input_norm: bool = False,
                 fc_bias: bool = True, attention_backend: str | None = None) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        text = LlamaConfig(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                           num_key_value_heads=num_key_value_heads or num_attention_heads,
                           intermediate_size=intermediate_size, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                           max_position_embeddings=max_position_embeddings, vocab_size=vocab_size,
                           num_hidden_layers=1)
        self.hidden_size, self.vocab_size, self.attention_backend = hidden_size, vocab_size, attention_backend
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(text, layer_idx=0)])
        if not input_norm:  # EAGLE's original first layer reads fc's output without an input norm
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(text)
        self.last_hidden: torch.Tensor | None = None  # [R, S, H] output features of the last forward_cached

    # ------------------------------------------------------------------------------------------ target
    def image_tokens_attended(self, num_image_tokens: int) -> float:
        """How many image tokens this drafter attends to per row (its prefill cost): all of them."""
        return num_image_tokens

    @classmethod
    def for_target(cls, target: CachedVLM, **overrides: Any) -> VLMEagleDrafter:
        """A fresh drafter shaped like the target's text model, attached to it."""
        c = target.model.config.text_config
        config = dict(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=getattr(c, "num_key_value_heads", None),
                      intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=_rope_theta(c), max_position_embeddings=c.max_position_embeddings,
                      vocab_size=c.vocab_size)
        drafter = cls(**{**config, **overrides})
        w = target.model.lm_head.weight
        drafter = drafter.to(w.device) if w.dtype == drafter.dtype else drafter.to(device=w.device, dtype=w.dtype)
        return drafter.attach(target)

    def attach(self, target: CachedVLM) -> VLMEagleDrafter:
        """Share the target's token embeddings and LM head (plain attributes: not saved); returns self."""
        check(isinstance(target, CachedVLM),
              f"attach needs a VLM target (vlm.target.cached_vlm), got {type(target).__name__}.")
        c = target.model.config.text_config
        bad = [f"{name}: drafter {getattr(self.config, name)!r} vs target {value!r}"
               for name, value in (("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size))
               if getattr(self.config, name) != value]
        if bad:
            raise InputError("this VLM drafter was made for another target (" + "; ".join(bad) + "); train one for "
                             "this target with `mmspec train vlm-drafter`.")
        self.__dict__["_target"] = target
        return self

    @property
    def target(self) -> CachedVLM:
        target = self.__dict__.get("_target")
        if target is None:
            raise InputError("the VLM drafter is not attached to its target; call drafter.attach(target).")
        return target

    # ------------------------------------------------------------------------------------------ forward
    def fuse(self, embeds: torch.Tensor, features: torch.Tensor, direct: torch.Tensor | None = None) -> torch.Tensor:
        """fc([embeds ; features]): [R, S, H] each -> [R, S, H]; elements where direct [R, S] bool is set read
        embeds itself (no fc, no feature)."""
        check(features.shape == embeds.shape and features.shape[-1] == self.hidden_size,
              f"features must be target features {list(embeds.shape)}, got {list(features.shape)}.")
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([embeds.to(dtype), features.to(dtype)], dim=-1))
        return x if direct is None else torch.where(direct.unsqueeze(-1), embeds.to(x.dtype), x)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on drafter features [..., H] -> float32 logits [..., V]."""
        return self.target.model.lm_head(hidden).float()

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layer over drafter inputs x [R, S, H] (after fc) with causal attention over valid [R, S]
        (all when None; padding hidden) at positions [R or 1, S] (default 1..S). Returns h [R, S, H]."""
        r, s = x.shape[:2]
        if positions is None:
            positions = torch.arange(1, s + 1, device=x.device).unsqueeze(0)  # [1, S]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril().unsqueeze(0).expand(r, -1, -1)  # [R,S,S]
        if valid is not None:
            mask = mask & valid.unsqueeze(1)
        return run_llama_layers(self.layers, self.rotary_emb, x, positions, mask, backend=self.attention_backend)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, direct: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced training forward over pairs (embeds e_{1..S} [R, S, H], features f_{0..S-1} [R, S, H])
        with causal attention over valid [R, S] at positions (default 1..S); direct [R, S] bool marks elements
        that enter as embeds alone. Returns the predicted features h [R, S, H]. Drafters with their own layouts
        (ViSpec, SpecVLM) pass prepared embeds, features, positions."""
        return self.run_layers(self.fuse(embeds, features, direct), positions, valid)

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        attn = self.layers[0].self_attn
        w = self.fc.weight
        return StaticKVCache(1, batch_size, attn.k_proj.out_features // attn.head_dim, capacity, attn.head_dim,
                             w.dtype, w.device)

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor, *, features: torch.Tensor,
                       embeds: torch.Tensor | None = None, direct: torch.Tensor | None = None) -> torch.Tensor:
        """Pairs (tokens [R, S] or their input embeddings `embeds` [R, S, H], features [R, S, H]; direct [R, S]
        bool: enter as embeds alone) at positions [R, S], written to cache slots [R, S], attending through mask
        [R, S, T]. Returns logits [R, S, V] and sets `last_hidden` [R, S, H]."""
        if embeds is None:
            embeds = self.target.embed_tokens(tokens)
        x = run_llama_layers(self.layers, self.rotary_emb, self.fuse(embeds, features, direct), positions, mask,
                             cache=cache, slots=slots, backend=self.attention_backend)
        self.last_hidden = x.detach()
        return self.head(x)


def _rope_theta(text_config) -> float:
    theta = getattr(text_config, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters, per layer type where layers differ (Gemma 3)
        params = getattr(text_config, "rope_parameters", None) or {}
        params = params.get("full_attention", params)
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


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
        target, drafter = self.target, self.drafter
        lengths = inputs.lengths.to(state.done.device)  # [B]
        b, p = inputs.input_ids.shape
        features = self.target_features(b, p, "prefill")  # [B, P, H]
        embeds = target.prompt_embeds  # [B, P, H]
        check(embeds is not None and embeds.shape[:2] == (b, p), "run the target's prefill (prefill_vlm) first.")
        capacity = p + state.max_new_tokens + self.width + self.max_pool
        cache = drafter.new_cache(b, capacity)
        self.runner.cache = cache
        if p > 1:  # the prompt's pairs (f_j, e_{j+1}), j < P_b - 1
            slots = cache.slots(p - 1)  # [B, P-1]
            self.runner.forward(None, slots + 1, slots, features=features[:, :-1], embeds=embeds[:, 1:],
                                **self.prompt_inputs(inputs))
            self.runner.commit_chain(lengths - 1)
        last = (lengths - 1).view(b, 1, 1).expand(-1, -1, features.shape[-1])
        self.pending = PendingPairs(state.last_token, features.gather(1, last)[:, 0], self.width)


VLMEagleDrafter.loop_drafter = VLMEagleTreeDrafter  # what the loop runs for this drafter model
