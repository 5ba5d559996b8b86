"""EAGLE-3 over a VLM target (drafter kind `eagle3`): the model `mmspec.eagle3.Eagle3Drafter` bound to a `CachedVLM`
(its input embeddings: text tokens and the merged image features, as EagleVLM reads them; the inputs of three of its
text model's decoder layers, captured by `CachedVLM.capture_layer_inputs`), drafting EAGLE-2 trees through the same
loop drafter as EagleVLM (`vlm.eagle.VLMEagleTreeDrafter`) whose target features are the fused layer inputs
[B, S, 3H] (`last_aux`) instead of the final hidden state. The serving engines' VLM drafters are EAGLE-3 heads (vLLM:
Qwen2.5-VL, Qwen3-VL, Llama 4; SGLang's SpecForge trains them); `mmspec train vlm-drafter --kind eagle3` trains one
with the training-time test, and `vlm.convert` reads and writes the official format.

Vision adaptor (an option no paper defines; `num_queries` 2, `mmspec train vlm-drafter --kind eagle3
--vision-adaptor`): ViSpec's `imadpt` and `img_fc` (`vlm.vispec`) on top of EAGLE-3's fusion. The image run is
replaced in the drafter's sequence by num_q - 1 compressed tokens, each entering the layer as [c ; c] (its own
residual, as ViSpec's enter the layer as themselves), and every later text element's g = fc(a) (or the drafter's own
output o at deeper drafts) becomes img_fc([g ; global image feature]) before the layer reads it. Trained by EAGLE-3's
training-time test over ViSpec's layout (`vlm.vispec.vispec_layout`): the test's later steps already feed the
drafter its own outputs, which ViSpec's anti-shortcut pass does for EAGLE-2. The official EAGLE-3 format has no
adaptor: such a drafter is saved and served by mmspec only.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.configuration_utils import register_to_config

from mmspec.eagle3 import Eagle3Drafter, default_aux_layers
from mmspec.errors import InputError, check
from mmspec.llama_drafter import llama_drafter_config
from vlm.eagle import SPECVLM_TREE, VLMEagleTreeDrafter
from vlm.target import CachedVLM
from vlm.vispec import VisionAdaptor, VLMViSpecTreeDrafter


class VLMEagle3Drafter(VisionAdaptor, Eagle3Drafter):
    """EAGLE-3 drafter over a VLM target (see the module docstring); `for_target(lm)` builds one shaped like the
    target's text model, a loaded one is `attach`ed before use."""

    official_tree = SPECVLM_TREE  # EAGLE-3's code: total_token 60, depth 7 (8 drafted levels), top_k 10

    @register_to_config
    def __init__(self, hidden_size: int = 4096, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 intermediate_size: int = 14336, rms_norm_eps: float = 1e-5, rope_theta: float = 500000.0,
                 max_position_embeddings: int = 8192, vocab_size: int = 128256, draft_vocab_size: int | None = None,
                 target_hidden_size: int | None = None, aux_layer_ids: tuple[int, ...] = (2, 16, 29),
                 attention_backend: str | None = None, num_queries: int = 0, qkv_bias: bool = False) -> None:
        super().__init__(hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps,
                         rope_theta, max_position_embeddings, vocab_size, draft_vocab_size, target_hidden_size,
                         aux_layer_ids, attention_backend)
        check(num_queries == 0 or num_queries >= 2, f"the vision adaptor needs at least 2 queries (compressed tokens "
                                                    f"+ global feature), got {num_queries} (0: no adaptor).")
        if num_queries:  # ViSpec's adaptor and img_fc (`vlm.vispec.VisionAdaptor`; starts as plain EAGLE-3)
            self.add_vision_adaptor(hidden_size, num_attention_heads, num_queries, qkv_bias, fc_bias=True)

    @property
    def vision_adaptor(self) -> bool:
        return bool(self.config.num_queries)

    @property
    def one_image_run(self) -> bool:
        """With the adaptor, ViSpec's layout: one image run a row."""
        return self.vision_adaptor

    @property
    def loop_drafter(self) -> type:
        """What the loop runs for this drafter: EAGLE-2 trees, over ViSpec's compressed prompt with the adaptor."""
        return VLMViSpec3TreeDrafter if self.vision_adaptor else VLMEagle3TreeDrafter

    def image_tokens_attended(self, num_image_tokens: int) -> float:
        """How many image tokens this drafter attends to per row (its prefill cost): all of them, or the adaptor's
        num_q - 1 compressed ones."""
        return self.config.num_queries - 1 if self.vision_adaptor else num_image_tokens

    def feature_to_fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g = fc(a) of the target's fused layer inputs [.., 3 H_t], or the drafter's own outputs [.., H]."""
        return self.fused_feature(features)

    @classmethod
    def for_target(cls, target: CachedVLM, draft_vocab_size: int | None = None, **overrides: Any) -> VLMEagle3Drafter:
        """A fresh drafter shaped like the target's text model (the official fused layers 2, L // 2, L - 3),
        attached to it."""
        c = target.model.config.text_config
        config = {**llama_drafter_config(c), "draft_vocab_size": draft_vocab_size,
                  "aux_layer_ids": default_aux_layers(c.num_hidden_layers), **overrides}
        return cls(**config).placed_like(target.model.lm_head.weight).attach(target)

    def attach(self, target: CachedVLM) -> VLMEagle3Drafter:
        """Share the target's token embeddings (not saved) and capture the inputs of the layers it fuses."""
        if not isinstance(target, CachedVLM):
            raise InputError(f"attach needs a VLM target (vlm.target.cached_vlm), got {type(target).__name__}.")
        c = target.model.config.text_config
        hint = "train one for this target with `mmspec train vlm-drafter --kind eagle3`"
        check(self.fc.in_features == 3 * c.hidden_size and self.hidden_size == c.hidden_size,
              f"this EAGLE-3 drafter fuses features of width {self.fc.in_features // 3} into {self.hidden_size}, the "
              f"target's are {c.hidden_size} wide; {hint}.")
        self.bind(target, {"vocab_size": c.vocab_size}, hint)
        target.capture_layer_inputs(tuple(self.config.aux_layer_ids))
        return self

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(tokens)


class VLMEagle3TreeDrafter(VLMEagleTreeDrafter):
    """EAGLE-2 dynamic trees from a `VLMEagle3Drafter`: `VLMEagleTreeDrafter` whose target features are the fused
    layer inputs [R, S, 3H] the target captured at its last forward."""

    def target_features(self, rows: int, positions: int, when: str) -> torch.Tensor:
        h = self.target.last_aux
        if h is None or h.dim() != 3 or tuple(h.shape[:2]) != (rows, positions):
            raise InputError(f"the EAGLE-3 drafter reads the target's layer inputs of its {when}, expected "
                             f"[{rows}, {positions}, 3H], got {None if h is None else list(h.shape)}; run it with the "
                             "pipeline's own target.")
        return h


class VLMViSpec3TreeDrafter(VLMEagle3TreeDrafter, VLMViSpecTreeDrafter):
    """EAGLE-2 trees from a `VLMEagle3Drafter` with the vision adaptor: ViSpec's `begin` (the compressed prompt
    layout, g, the per-row position offsets) over the fused layer inputs the target captured."""
