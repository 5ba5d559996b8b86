"""The EAGLE feature drafter model with one Llama decoder layer, shared by every family whose target is a
transformers model (the VLMs' EagleVLM / ViSpec / MSD / SpecVLM drafters, the transformers image generators'
EAGLE drafter):

    x_i = fc([e_i ; f_{i-1}])        # [R, S, 2H] -> [R, S, H]; fc has a bias
    h_i = one Llama decoder layer(x_i) at position i (RoPE with the target's base)
    logits_i = head(h_i)             # the target's frozen head, no final norm (EAGLE)

e_i is what the target reads for element i (`embed_tokens`, or embeddings given directly), f_{i-1} the target's
final normed hidden state that predicts it; h_i regresses f_i. Elements marked `direct` skip fc and enter the layer
as e_i itself (MSD's image positions, ViSpec's compressed image tokens). The layer is a transformers
`LlamaDecoderLayer` run through mmspec's attention backends (`mmspec.draft_layers`); `input_norm=False` (the
default) is EAGLE's layer 0 without its input RMSNorm, `input_norm=True` keeps it (SpecVLM's EagleVLM).

A family subclass binds a target: `for_target`, `attach` (the target is a plain attribute, never saved),
`embed_tokens` and `head`.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mmspec.attention.model_backend import AttentionBackendMixin
from mmspec.cache import StaticKVCache
from mmspec.draft_layers import run_llama_layers
from mmspec.errors import InputError


def rope_theta_of(text_config) -> float:
    """A transformers text config's RoPE base (transformers >= 5 keeps it in rope_parameters, per layer type where
    layers differ, as Gemma 3); 10000 when it names none."""
    theta = getattr(text_config, "rope_theta", None)
    if theta is None:
        params = getattr(text_config, "rope_parameters", None) or {}
        params = params.get("full_attention", params)
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def llama_drafter_config(text_config, vocab_size: int | None = None) -> dict[str, Any]:
    """The drafter's shape from the target's text config: width, heads, FFN size, norm eps, RoPE base."""
    c = text_config
    return dict(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=getattr(c, "num_key_value_heads", None), intermediate_size=c.intermediate_size,
                rms_norm_eps=c.rms_norm_eps, rope_theta=rope_theta_of(c),
                max_position_embeddings=c.max_position_embeddings,
                vocab_size=c.vocab_size if vocab_size is None else vocab_size)


class TargetBound:
    """A drafter model (a diffusers `ModelMixin` + `ConfigMixin`) that reads its target's embeddings and head without
    owning them: `bind` keeps the target as a plain attribute (not a submodule, never saved) after checking the config
    fields the two must share; `target` reads it; `placed_like` moves the drafter next to a target weight."""

    def placed_like(self, weight: torch.Tensor):
        """self on the device (and in the dtype) of a target weight."""
        return self.to(weight.device) if weight.dtype == self.dtype else self.to(device=weight.device,
                                                                                 dtype=weight.dtype)

    def bind(self, target: Any, expected: dict[str, Any], retrain_hint: str):
        """Attach `target` after checking the config fields in `expected` agree with it; InputError naming the
        mismatch and `retrain_hint` otherwise. Returns self."""
        bad = [f"{name}: drafter {getattr(self.config, name)!r} vs target {value!r}"
               for name, value in expected.items() if getattr(self.config, name) != value]
        if bad:
            raise InputError("this drafter was made for another target (" + "; ".join(bad) + f"); {retrain_hint}.")
        self.__dict__["_target"] = target
        return self

    @property
    def target(self) -> Any:
        target = self.__dict__.get("_target")
        if target is None:
            raise InputError("the drafter is not attached to its target; call drafter.attach(target).")
        return target


class LlamaFeatureDrafter(TargetBound, AttentionBackendMixin, ModelMixin, ConfigMixin):
    """EAGLE feature drafter with one Llama decoder layer (see the module docstring); subclasses bind a target."""

    attends_without_mask = True  # forward_cached takes mask None (`mmspec.lm.CachedLM`)
    runs_one_column = True  # forward_cached takes query_column (`FeatureTreeDrafter.run_pending`)

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
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the target reads for tokens [R, S] -> [R, S, H] (the family's)."""
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's head on drafter features [..., H] -> float32 logits [..., V] (the family's)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ forward
    def fuse(self, embeds: torch.Tensor, features: torch.Tensor, direct: torch.Tensor | None = None) -> torch.Tensor:
        """fc([embeds ; features]): [R, S, H] each -> [R, S, H]; elements where direct [R, S] bool is set read
        embeds itself (no fc, no feature)."""
        if features.shape != embeds.shape or features.shape[-1] != self.hidden_size:  # (no message built per step)
            raise InputError(f"features must be target features {list(embeds.shape)}, got {list(features.shape)}.")
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([embeds.to(dtype), features.to(dtype)], dim=-1))
        return x if direct is None else torch.where(direct.unsqueeze(-1), embeds.to(x.dtype), x)

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
        that enter as embeds alone. Returns the predicted features h [R, S, H]."""
        return self.run_layers(self.fuse(embeds, features, direct), positions, valid)

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        attn = self.layers[0].self_attn
        w = self.fc.weight
        return StaticKVCache(1, batch_size, attn.k_proj.out_features // attn.head_dim, capacity, attn.head_dim,
                             w.dtype, w.device)

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor, *, features: torch.Tensor,
                       embeds: torch.Tensor | None = None, direct: torch.Tensor | None = None,
                       logits: bool = True, query_column: torch.Tensor | None = None) -> torch.Tensor | None:
        """Pairs (tokens [R, S] or their input embeddings `embeds` [R, S, H], features [R, S, H]; direct [R, S]
        bool: enter as embeds alone) at positions [R, S], written to cache slots [R, S], attending through mask
        [R, S, T]. Returns logits [R, S, V] and sets `last_hidden` [R, S, H]. logits=False returns None and sets
        `last_hidden` None: a prompt pass that only fills the cache (EAGLE's code runs the head on the prompt's last
        position alone; mmspec's first draft reads the target's feature there) runs neither the head, the
        drafter's largest product for a large vocabulary (Qwen2.5-VL-7B's 152k-token head has 2.3x the
        multiply-adds of its decoder layer a position), nor the layer past its K/V (`write_layer_kv`).
        query_column [R]: every pair's K/V is written, the logits [R, 1, V] and `last_hidden` [R, 1, H] are those
        of that column of each row alone (`run_layer_column`; mask must be given)."""
        if embeds is None:
            embeds = self.embed_tokens(tokens)
        x = run_llama_layers(self.layers, self.rotary_emb, self.fuse(embeds, features, direct), positions, mask,
                             cache=cache, slots=slots, backend=self.attention_backend, cache_only=not logits,
                             query_column=query_column)
        self.last_hidden = None if x is None else x.detach()
        return None if x is None else self.head(x)
