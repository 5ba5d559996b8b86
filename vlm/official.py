"""LLaVA targets at official sizes with random weights, and drafters at their width: what a step costs there.

    vlm = random_vlm("llava-1.5-7b", device="cuda", dtype=torch.bfloat16)   # SpeculativeVLM, no drafter
    drafters = random_drafters(vlm)                                          # {"eagle", "vispec", "msd"}
    mmspec bench --family vlm --family-option size=llava-1.5-7b --force-acceptance tau=3.0:depth=6 ...

A forward costs the same whatever the weights; acceptance comes from `mmspec bench --force-acceptance`
(`mmspec.forced`). The processor is the world's (`vlm.world.world_processor`) at the official image geometry (336 px,
patch 14: 576 image tokens), so the inputs are world scenes and questions; the vocabulary is the official size (the
world tokenizer's ids lie inside it), so the embedding and the LM head cost what they do officially. Configurations
(transformers' config.json of each model):
- the vision tower CLIP ViT-L/14-336 (openai/clip-vit-large-patch14-336: 24 layers, width 1024, 16 heads, MLP 4096),
  layer -2's patch features, CLS dropped, a two-layer GELU projector (LLaVA-1.5);
- llava-1.5-7b / llava-1.5-13b: Vicuna-7B / 13B (llava-hf/llava-1.5-7b-hf, -13b-hf: 32 layers x 4096, MLP 11008,
  32 heads / 40 layers x 5120, MLP 13824, 40 heads; vocabulary 32064);
- llava-qwen2-0.5b / llava-qwen2-1.5b: the LLaVA-1.5 layout above over Qwen2-0.5B / 1.5B's text model (the backbone
  of LLaVA-OneVision-0.5B; Qwen/Qwen2-0.5B, -1.5B: 24 layers x 896, MLP 4864, 14 heads, 2 KV heads / 28 x 1536, MLP
  8960, 12 heads, 2 KV heads; vocabulary 151936, tied embeddings): not a released model, the sizes a CPU runs.
The drafters (`random_drafters`) are each kind's model shaped for the target (`for_target`: one decoder layer at the
target's width).
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.errors import check

CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768)
VICUNA = dict(vocab_size=32064, rms_norm_eps=1e-5, max_position_embeddings=4096)
QWEN2 = dict(vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1e6,
             tie_word_embeddings=True)
TEXT: dict[str, tuple[str, dict[str, Any]]] = {  # size -> (text model type, its config)
    "llava-1.5-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=32, **VICUNA)),
    "llava-1.5-13b": ("llama", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                    num_attention_heads=40, num_key_value_heads=40, **VICUNA)),
    "llava-qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, **QWEN2)),
    "llava-qwen2-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2, **QWEN2)),
}
SIZES = tuple(TEXT)
DRAFTER_KINDS = ("eagle", "vispec", "msd")  # the drafters shaped for a random target (SpecVLM's needs training)


def official_config(size: str, tokenizer, vision_overrides: dict | None = None, **text_overrides: Any):
    """The `LlavaConfig` of `size` over `tokenizer`'s special ids (InputError naming the sizes otherwise);
    overrides change config fields (tests: smaller towers)."""
    from transformers import AutoConfig, CLIPVisionConfig, LlavaConfig

    check(size in TEXT, f"unknown VLM size {size!r}; sizes: {', '.join(SIZES)}.")
    text_type, text = TEXT[size]
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    text_config = AutoConfig.for_model(text_type, **{**text, **text_overrides}, **ids)
    side = CLIP_L_336["image_size"] // CLIP_L_336["patch_size"]
    vision = CLIPVisionConfig(**{**CLIP_L_336, **(vision_overrides or {})})
    return LlavaConfig(vision_config=vision, text_config=text_config,
                       image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=side * side,
                       projector_hidden_act="gelu", vision_feature_select_strategy="default",
                       vision_feature_layer=-2, tie_word_embeddings=text.get("tie_word_embeddings", False), **ids)


def random_vlm(size: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
               vision_overrides: dict | None = None, **text_overrides: Any):
    """A `SpeculativeVLM` over the random-weight LLaVA of `size` (see the module docstring), built on `device` and
    cast to `dtype`; overrides change config fields (tests: fewer layers)."""
    from transformers import LlavaForConditionalGeneration

    from vlm.pipeline import SpeculativeVLM
    from vlm.world import world_processor

    processor = world_processor(image_size=CLIP_L_336["image_size"], patch_size=CLIP_L_336["patch_size"])
    config = official_config(size, processor.tokenizer, vision_overrides, **text_overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlavaForConditionalGeneration(config)
    return SpeculativeVLM(model.to(dtype).eval(), processor)


def random_drafters(vlm, kinds: tuple[str, ...] = DRAFTER_KINDS) -> dict[str, Any]:
    """{kind: a random drafter of that kind shaped for `vlm`'s target, in its dtype and on its device}."""
    from vlm.family import drafter_model

    return {kind: drafter_model(kind).for_target(vlm.lm).eval() for kind in kinds}
