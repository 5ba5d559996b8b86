"""The embedded world as a Qwen2-VL target: a small `Qwen2VLForConditionalGeneration` for the world's 32x32 images
and its `Qwen2VLProcessor`, built offline from the world tokenizer (nothing is downloaded).

Sizes follow the world LLaVA's text model (`vlm.world.WORLD_TEXT`); the vision tower is Qwen2-VL's own (patch 4,
2x2 merge, temporal patch 2), so a 32x32 image is 8x8 patches merged into 4x4 = 16 image tokens whose M-RoPE
positions span a 4x4 grid. The tokenizer is the world's plus Qwen2-VL's `<|vision_start|>`, `<|vision_end|>`,
`<|image_pad|>` (the image token, `image_token_id`) and `<|video_pad|>`, so a prompt reads
"USER: <|vision_start|><|image_pad|><|vision_end|>\\n{question} ASSISTANT:" (`SpeculativeVLM.prompt_text`).

    config = world_qwen2_vl_config()          # ~4M parameters
    processor = world_qwen2_vl_processor()    # images -> pixel_values, image_grid_thw; <image> -> 16 pads
"""

from __future__ import annotations

from mmspec.data import load_world_tokenizer
from mmspec.errors import check
from vlm.world import IMAGE_SIZE, WORLD_TEXT

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
WORLD_QWEN_VISION: dict = dict(depth=3, embed_dim=128, num_heads=4, mlp_ratio=4, patch_size=4, spatial_merge_size=2,
                               temporal_patch_size=2, in_channels=3)


def world_qwen2_vl_tokenizer():
    """The world tokenizer with Qwen2-VL's vision delimiters added (a fresh copy each call)."""
    tok = load_world_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [tok.image_token, *VISION_TOKENS]})
    tok.image_token = "<|image_pad|>"  # Qwen2VLProcessor's default, so a saved and reloaded processor agrees
    tok.image_token_id = tok.convert_tokens_to_ids(tok.image_token)
    return tok


def world_qwen2_vl_config(vision: dict | None = None, text: dict | None = None, tokenizer=None):
    """A `transformers.Qwen2VLConfig` for world images: `vision` / `text` override WORLD_QWEN_VISION /
    WORLD_TEXT entries (e.g. tiny test models). The M-RoPE sections split head_dim / 2 as 1 : 1.5 : 1.5 (t, h, w),
    Qwen2-VL-7B's 16 : 24 : 24."""
    from transformers import Qwen2VLConfig

    tok = tokenizer if tokenizer is not None else world_qwen2_vl_tokenizer()
    text_kw = {**WORLD_TEXT, **(text or {})}
    text_kw.pop("rope_theta", None)
    tie = text_kw.pop("tie_word_embeddings")
    half = text_kw["hidden_size"] // text_kw["num_attention_heads"] // 2
    check(half % 4 == 0, f"head_dim / 2 = {half} must be a multiple of 4 to split into M-RoPE sections.")
    sections = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision_kw = {**WORLD_QWEN_VISION, "hidden_size": text_kw["hidden_size"], **(vision or {})}
    start, end, _, video = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    text_config = dict(vocab_size=len(tok), rope_parameters=dict(rope_type="default", mrope_section=sections,
                                                                 rope_theta=10000.0),
                       tie_word_embeddings=tie, **ids, **text_kw)
    return Qwen2VLConfig(text_config=text_config, vision_config=vision_kw, image_token_id=tok.image_token_id,
                         video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                         tie_word_embeddings=tie, **ids)


def world_qwen2_vl_processor(tokenizer=None, image_size: int = IMAGE_SIZE):
    """A `transformers.Qwen2VLProcessor` that keeps world images at image_size x image_size (its smart resize to
    multiples of patch 4 x merge 2 is a no-op for 32x32), rescales to [0, 1] and normalises with CLIP's mean
    and std (Qwen2-VL's). Saves and loads with save_pretrained / `AutoProcessor.from_pretrained(folder)`."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tok = tokenizer if tokenizer is not None else world_qwen2_vl_tokenizer()
    pixels = image_size * image_size
    sizes = dict(patch_size=WORLD_QWEN_VISION["patch_size"], merge_size=WORLD_QWEN_VISION["spatial_merge_size"],
                 temporal_patch_size=WORLD_QWEN_VISION["temporal_patch_size"],
                 size={"shortest_edge": pixels, "longest_edge": pixels}, do_convert_rgb=False)
    # transformers' processor class requires a video processor; mmspec's targets take images only
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=tok,
                            video_processor=Qwen2VLVideoProcessor(**sizes))
