"""Tiny random VLM targets of every supported family with their own processors, built offline over the embedded
world's tokenizer: for tests, docs examples and checks that need the real code paths at a small size.

    vlm = tiny_vlm("qwen2_vl")                          # a SpeculativeVLM: Qwen2VLForConditionalGeneration + processor
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    enc = vlm.processor(images=images, text=[vlm.prompt_text(q) for q in questions], padding=True,
                        return_tensors="pt")
    vlm.generate(**enc, max_new_tokens=8) == vlm.model.generate(**enc, max_new_tokens=8, do_sample=False)

Families (`TINY_FAMILIES`): "llava" (LLaVA-1.5: CLIP + a text backbone of `SUPPORTED_TEXT_MODELS`, Llama by
default), "qwen2_vl", "gemma3" (SigLIP, 4 tokens per image, bidirectional image attention), "llava_next" (CLIP + Llama,
any-resolution tiles) and "llava_onevision" (SigLIP + Qwen2). Text models have 2 layers of width 32; the LM head is
scaled by `peak` so next-token laws are peaked and drafts get accepted. The weights are random, seeded.
"""

from __future__ import annotations

from typing import Any

import torch

TINY_FAMILIES = ("llava", "qwen2_vl", "gemma3", "llava_next", "llava_onevision")
TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # LLaVA-NeXT / OneVision tiles of the tiny models
GEMMA3_SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def tiny_text_config(backbone: str, **fields: Any):
    """A tiny text config of `backbone` (a transformers model_type of `vlm.target.SUPPORTED_TEXT_MODELS`) with
    what makes it differ from Llama on (Qwen3's q/k norms, Gemma's scaled embeddings, sliding windows); `fields`
    (vocab_size, token ids, sizes) override."""
    import transformers as tf

    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, **fields)
    head = dict(head_dim=8)
    made = {
        "llama": lambda: tf.LlamaConfig(**base),
        "mistral": lambda: tf.MistralConfig(**base, sliding_window=128),
        "qwen2": lambda: tf.Qwen2Config(**base),
        "qwen3": lambda: tf.Qwen3Config(**base, **head),  # q_norm / k_norm per head before RoPE
        "gemma": lambda: tf.GemmaConfig(**base, **head),  # embeddings scaled by sqrt(hidden), (1 + w) norms
        "gemma2": lambda: tf.Gemma2Config(**base, **head, sliding_window=128, attn_implementation="eager"),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**base, **head, sliding_window=128, query_pre_attn_scalar=8),
    }
    return made[backbone]()


def tiny_vlm(family: str = "llava", *, backbone: str = "llama", seed: int = 0, peak: float = 10.0):
    """A `SpeculativeVLM` (no drafter) over a tiny random target of `family` and its processor (see the module
    docstring); `backbone` is the text model of "llava"."""
    from vlm.pipeline import SpeculativeVLM

    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}.")
    torch.manual_seed(seed)
    model, processor = {"llava": lambda: _llava(backbone), "qwen2_vl": _qwen2_vl, "gemma3": _gemma3,
                        "llava_next": lambda: _tiled("llava_next"),
                        "llava_onevision": lambda: _tiled("llava_onevision")}[family]()
    model.eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)  # peaked laws, so drafts are sometimes accepted
    return SpeculativeVLM(model, processor)


def _llava(backbone: str):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from vlm.world import world_llava_config, world_processor

    config = world_llava_config(vision=TINY_VISION, text=TINY_TEXT)
    if backbone != "llama":
        text = config.text_config
        ids = {k: getattr(text, k) for k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
        config = LlavaConfig(vision_config=config.vision_config, text_config=tiny_text_config(backbone, **ids),
                             **{k: getattr(config, k) for k in ("image_token_index", "image_seq_length",
                                                                 "projector_hidden_act", "vision_feature_layer",
                                                                 "vision_feature_select_strategy")})
    return LlavaForConditionalGeneration(config), world_processor()


def _qwen2_vl():
    from transformers import Qwen2VLForConditionalGeneration

    from vlm.world_qwen2_vl import world_qwen2_vl_config, world_qwen2_vl_processor

    config = world_qwen2_vl_config(vision=dict(depth=1, embed_dim=32, num_heads=2), text=TINY_TEXT)
    return Qwen2VLForConditionalGeneration(config), world_qwen2_vl_processor()


def _gemma3():
    import transformers as tf

    from mmspec.data import load_world_tokenizer

    tok = load_world_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_SPECIAL.values())})
    for name, token in GEMMA3_SPECIAL.items():  # what Gemma3Processor reads off the tokenizer
        setattr(tok, name, token)
        setattr(tok, f"{name}_id", tok.convert_tokens_to_ids(token))
    text = tf.Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                               sliding_window=256, layer_types=["sliding_attention", "full_attention"],
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    vision = tf.SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id, image_token_index=tok.image_token_id))
    processor = tf.Gemma3Processor(image_processor=tf.Gemma3ImageProcessor(size={"height": 32, "width": 32},
                                                                           do_convert_rgb=False),
                                   tokenizer=tok, image_seq_length=4)
    return model, processor


def _tiled(kind: str):
    """A tiny LLaVA-NeXT (CLIP, Llama) or OneVision (SigLIP, Qwen2) target with its any-resolution processor."""
    import transformers as tf

    from mmspec.data import load_world_tokenizer

    tok = load_world_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [tok.image_token, "<video>"]})
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2)
    if kind == "llava_next":
        model = tf.LlavaNextForConditionalGeneration(tf.LlavaNextConfig(
            vision_config=tf.CLIPVisionConfig(**vision), text_config=tf.LlamaConfig(**text),
            image_token_index=tok.image_token_id, image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
            vision_feature_select_strategy="default", image_seq_length=16))
        processor = tf.LlavaNextProcessor(
            image_processor=tf.LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32,
                                                                                              "width": 32},
                                                       image_grid_pinpoints=PINPOINTS, do_convert_rgb=False),
            tokenizer=tok, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1)
        return model, processor
    model = tf.LlavaOnevisionForConditionalGeneration(tf.LlavaOnevisionConfig(
        vision_config=tf.SiglipVisionConfig(**vision), text_config=tf.Qwen2Config(**text),
        image_token_index=tok.image_token_id, video_token_index=tok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1, vision_feature_select_strategy="full"))
    square = {"height": 32, "width": 32}
    processor = tf.LlavaOnevisionProcessor(
        image_processor=tf.LlavaOnevisionImageProcessor(size=square, image_grid_pinpoints=PINPOINTS,
                                                        do_convert_rgb=False),
        tokenizer=tok, video_processor=tf.LlavaOnevisionVideoProcessor(size=square), num_image_tokens=16,
        vision_feature_select_strategy="full")
    return model, processor


def tiny_processor_batch(vlm, n: int = 3, seed: int = 1, padding_side: str = "left") -> dict:
    """The processor's outputs for `n` world questions about world images (the tiny models' images), one image per
    row, padded on `padding_side` (transformers' `generate` takes left padding): what a transformers user passes to
    `model.generate(**enc)` and `SpeculativeVLM.generate(**enc)`."""
    from vlm.world import world_vqa_examples

    examples = world_vqa_examples("test", n, seed=seed)
    texts = [vlm.prompt_text(ex.qa.question + " Answer in detail." * (i % 2)) for i, ex in enumerate(examples)]
    images = [[ex.image] if vlm.lm.images_nested_per_row else ex.image for ex in examples]
    tokenizer = vlm.processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, padding_side
    try:
        return vlm.processor(images=images, text=texts, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
