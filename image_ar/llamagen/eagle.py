"""EAGLE-style feature drafter for LlamaGen (LANTERN's drafter) and its EAGLE-2 tree drafter for the loop.

The model (`LlamaGenEagleDrafter`, LANTERN `cnets_llamagen.py` / EAGLE `cnets.py` from the facts):

    x_i = fc([tok_embeddings(img_i) ; f_i])          # [R, S, 2 dim] -> [R, S, dim], fc has a bias
    h_i = decoder layer(x_i) at the target's absolute position of img_i, the target's 2D RoPE
    logits_i = output(h_i)                           # the target's frozen head, NO final norm (as EAGLE)

`f_i` is the target's final normed hidden state (`LlamaGenGPT.last_hidden`) at the position that PREDICTS
img_i (the last condition position for img_0, img_{i-1}'s position after that); `h_i` regresses f_{i+1}, so
`output(h_i)` predicts img_{i+1}. The decoder layer is a LlamaGen block (SwiGLU, 2D RoPE, GQA), without the
input RMSNorm in the first layer (EAGLE; `input_norm=True` adds it, as SpecVLM suggests). The token embeddings
and the head are the target's, frozen and shared: `attach(target)` links them (they are not submodules, so
`save_pretrained` writes only the drafter's own fc and layer weights).

Sequence layout: the drafter's cache holds only image elements, element i at cache slot i and absolute
position `cls_token_num + i` (the target's position of img_i; condition positions never appear, their
information reaches the drafter through f_0). Classifier-free guidance: the drafter runs 2B rows, the
conditional and unconditional halves each with their own target features and the same tokens, and combines
its own logits (`uncond + scale * (cond - uncond)`, `mmspec.lm.GuidedRunner`) before ranking children.

The loop drafter (`EagleTreeDrafter`) is `mmspec.feature_drafter.FeatureTreeDrafter` (EAGLE-2 dynamic trees and
the feature bookkeeping, shared with the VLM drafters) with LlamaGen's start: after prefill the one pending pair
is (f_0 = prefill `last_hidden[:, -1]`, img_0), with the same tokens in both CFG halves.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from image_ar.llamagen.gpt import LlamaGenGPT, TransformerBlock, causal_mask, ffn_hidden_dim
from image_ar.llamagen.rope import RopePositions, grid_size_of, rope_table_2d
from mmspec.attention.model_backend import AttentionBackendMixin
from mmspec.cache import StaticKVCache
from mmspec.errors import check, check_positive_int
from mmspec.feature_drafter import FeatureTreeDrafter, PendingPairs
from mmspec.llama_drafter import TargetBound
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams
from mmspec.tree import levels_of_eagle_depth

# LANTERN's LlamaGen tree (`ea_model_llamagen.py`: total_token=59, depth=4, top_k=10, i.e. 5 draft levels)
DEFAULT_TOP_K = 10
DEFAULT_DEPTH = levels_of_eagle_depth(4)
DEFAULT_TOTAL_TOKENS = 59

# config fields that must agree with the target the drafter is attached to
_TARGET_FIELDS = ("dim", "vocab_size", "block_size", "cls_token_num", "rope_base")


class LlamaGenEagleDrafter(TargetBound, AttentionBackendMixin, RopePositions, ModelMixin, ConfigMixin):
    """EAGLE feature drafter over a LlamaGen target (see the module docstring). Build it for a target with
    `for_target(target)`; a loaded one must be `attach`ed to the target before use."""

    attends_without_mask = True  # forward_cached takes mask None (`mmspec.lm.CachedLM`)

    @register_to_config
    def __init__(
        self,
        dim: int = 768,
        n_head: int = 12,
        n_kv_head: int | None = None,
        n_layer: int = 1,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        rope_base: float = 10000.0,
        block_size: int = 256,
        cls_token_num: int = 1,
        vocab_size: int = 16384,
        fc_bias: bool = True,
        input_norm: bool = False,
        attention_backend: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("n_head", n_head), ("n_layer", n_layer), ("multiple_of", multiple_of),
                            ("cls_token_num", cls_token_num), ("vocab_size", vocab_size)):
            check_positive_int(name, value)
        check(dim % n_head == 0, f"dim ({dim}) must be divisible by n_head ({n_head}).")
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        check(isinstance(self.n_kv_head, int) and self.n_kv_head >= 1 and n_head % self.n_kv_head == 0,
              f"n_kv_head must be None or a positive divisor of n_head ({n_head}), got {n_kv_head!r}.")
        self.dim, self.n_head, self.head_dim, self.n_layer = dim, n_head, dim // n_head, n_layer
        self.vocab_size, self.block_size, self.cls_token_num = vocab_size, block_size, cls_token_num
        self.attention_backend = attention_backend
        self.fc = nn.Linear(2 * dim, dim, bias=fc_bias)
        hidden = ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_head, self.n_kv_head, hidden, norm_eps, 0.0, 0.0, 0.0)
                                    for _ in range(n_layer))
        if not input_norm:  # EAGLE: the first layer reads fc's output without an input norm
            self.layers[0].attention_norm = nn.Identity()
        self._rope = rope_table_2d(grid_size_of(block_size), self.head_dim, rope_base, cls_token_num)  # float32
        self.last_hidden: torch.Tensor | None = None  # [R, S, dim] output features of the last forward_cached

    # ------------------------------------------------------------------------------------------ target
    @classmethod
    def for_target(cls, target: LlamaGenGPT, **overrides: Any) -> LlamaGenEagleDrafter:
        """A fresh drafter shaped like `target` (its width, heads, FFN size, RoPE, positions), attached to it."""
        c = target.config
        config = dict(dim=c.dim, n_head=c.n_head, n_kv_head=c.n_kv_head, multiple_of=c.multiple_of,
                      ffn_dim_multiplier=c.ffn_dim_multiplier, norm_eps=c.norm_eps, rope_base=c.rope_base,
                      block_size=c.block_size, cls_token_num=c.cls_token_num, vocab_size=c.vocab_size)
        return cls(**{**config, **overrides}).placed_like(target.tok_embeddings.weight).attach(target)

    def attach(self, target: LlamaGenGPT) -> LlamaGenEagleDrafter:
        """Share `target`'s token embeddings and output head (not registered, so never saved); returns self."""
        check(isinstance(target, LlamaGenGPT), f"attach needs the LlamaGen target, got {type(target).__name__}.")
        return self.bind(target, {name: getattr(target.config, name) for name in _TARGET_FIELDS},
                         "retrain it with `mmspec train llamagen-drafter --pipeline PIPELINE --out "
                         "PIPELINE/eagle_drafter`")

    # ------------------------------------------------------------------------------------------ forward
    def embed_pairs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([tok_embeddings(tokens) ; features]): tokens [R, S], features [R, S, dim] -> [R, S, dim]."""
        check(isinstance(features, torch.Tensor) and features.dim() == 3
              and tuple(features.shape) == (*tokens.shape, self.dim),
              f"features must be target features [R, S, dim] = [{tokens.shape[0]}, {tokens.shape[1]}, {self.dim}], "
              f"got {list(getattr(features, 'shape', []))}.")
        dtype = self.fc.weight.dtype
        emb = self.target.tok_embeddings(tokens).to(dtype)  # [R, S, dim]
        return self.fc(torch.cat([emb, features.to(dtype)], dim=-1))  # [R, S, dim]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output head on drafter features [..., dim] -> float32 logits [..., V]."""
        return self.target.output(hidden).float()

    def forward(self, features: torch.Tensor, tokens: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced training forward: pairs (features [R, S, dim], tokens [R, S]) with full causal attention,
        at positions [S] (default: image tokens 0..S-1, `cls_token_num + arange(S)`). Returns the predicted next
        features [R, S, dim]."""
        check(isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and not tokens.is_floating_point(),
              f"tokens must be integer image tokens [R, S], got {list(getattr(tokens, 'shape', []))}.")
        s = tokens.shape[1]
        check(1 <= s <= self.block_size, f"at most block_size ({self.block_size}) pairs per row, got {s}.")
        if positions is None:
            positions = self.cls_token_num + torch.arange(s, device=tokens.device)  # [S]
        x = self.embed_pairs(tokens, features)  # [R, S, dim]
        rope = self.rope_rows(positions)  # [S, 2, hd]
        mask = causal_mask(s, tokens.device)  # [1, S, S]
        for layer in self.layers:
            x = layer(x, rope, mask, backend=self.attention_backend)
        return x  # [R, S, dim]

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        """An empty cache for `batch_size` rows (2B with CFG) of `capacity` image elements."""
        p = self.fc.weight
        return StaticKVCache(self.n_layer, batch_size, self.n_kv_head, capacity, self.head_dim, p.dtype, p.device)

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor, *,
                       features: torch.Tensor | None = None) -> torch.Tensor:
        """Pairs (tokens [R, S], features [R, S, dim]) at absolute positions [R, S], written to cache slots [R, S],
        attending through mask [R, S, T]. Returns logits [R, S, V] and sets `last_hidden` [R, S, dim]."""
        check(features is not None, "the eagle drafter needs the target features of its input pairs (features=).")
        x = self.embed_pairs(tokens, features)  # [R, S, dim]
        rope = self.rope_rows(positions)  # [R, S, 2, hd]
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, mask, cache=cache, layer_index=i, slots=slots, backend=self.attention_backend)
        self.last_hidden = x.detach()
        return self.head(x)  # [R, S, V]


# ---------------------------------------------------------------------------------------------- loop drafter
class EagleTreeDrafter(FeatureTreeDrafter):
    """The loop's drafter: EAGLE-2 dynamic trees from a `LlamaGenEagleDrafter` over the target's features
    (`mmspec.feature_drafter.FeatureTreeDrafter`; drafter element j at position cls_token_num + j).

    `params` are the target's sampling settings: at temperature > 0 the drafter ranks children by log-probs of
    its CFG-combined logits after the same temperature / top-k / top-p processing (LANTERN; `child_ranking=
    "processed"`, this family's default), at temperature 0 by the raw log-softmax; `child_ranking="raw"` is
    EAGLE's ranking at every temperature. The drafter's cache holds image elements only; the condition reaches
    it through f_0.
    """

    def __init__(self, drafter: LlamaGenEagleDrafter, target: LlamaGenGPT, params: SamplingParams, *,
                 top_k: int = DEFAULT_TOP_K, depth: int = DEFAULT_DEPTH, total_tokens: int = DEFAULT_TOTAL_TOKENS,
                 guidance_scale: float | torch.Tensor | None = None, child_ranking: str = "processed"):
        super().__init__(drafter.attach(target), target, params, top_k=top_k, depth=depth,
                         total_tokens=total_tokens, position_offset=drafter.cls_token_num,
                         guidance_scale=guidance_scale, child_ranking=child_ranking)
        self.drafter = drafter

    def begin(self, inputs: Any, state: DecodeState) -> None:
        rows = state.batch_size * (2 if self.runner.uses_cfg else 1)
        prefill = self.target_features(rows, self.target.config.cls_token_num, "prefill")  # [R, C, dim]
        self.new_drafter_cache(rows, self.drafter.block_size + self.width)
        self.pending = PendingPairs(state.last_token, prefill[:, -1], self.width)  # (f_0, img_0)
