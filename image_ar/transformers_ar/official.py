"""Janus-Pro, Emu3 and Lumina-mGPT at their official sizes with random weights: what a step costs at the sizes users
run.

    pipe = random_janus_pipeline("janus-pro-7b", device="cuda", dtype=torch.bfloat16)
    pipe = random_emu3_pipeline("emu3-gen", device="cuda", dtype=torch.bfloat16)
    pipe = random_lumina_mgpt_pipeline("lumina-mgpt-7b-768", device="cuda", dtype=torch.bfloat16)
    mmspec bench --family janus --family-option size=janus-pro-1b --force-acceptance tau=2.31:depth=16 ...

A forward costs the same whatever the weights; acceptance comes from `mmspec bench --force-acceptance`
(`mmspec.forced`). The processor is the world tokenizer's with Janus's image tokens (`image_ar.transformers_ar.tiny`)
at the official image geometry (384 px, 576 image tokens); the vocabulary is the official size (the world
tokenizer's ids lie inside it), so the embedding and the text head cost what they do officially. Configurations
(deepseek-ai/Janus-Pro-1B and -7B config.json, as transformers' conversion reads them):
- janus-pro-1b: the language model 24 layers x 2048, MLP 5632, 16 heads (DeepSeek-LLM-1.3B's shape), untied head;
- janus-pro-7b: 30 layers x 4096, MLP 11008, 32 heads (DeepSeek-LLM-7B's), untied head;
- both: vocabulary 102400, 16384 positions; the understanding tower SigLIP-L/16 at 384 px (24 layers x 1024) and its
  two-layer aligner; the generation side: VQ-16 (16384 codes x 8), a two-layer aligner and the image head at the
  language model's width;
- emu3-gen (BAAI/Emu3-Gen-hf): 32 layers x 4096, MLP 14336, 32 heads, 8 KV heads, vocabulary 184622, 9216
  positions, RoPE theta 1e6; the MoVQGAN tokenizer with 32768 codes x 4 (transformers' `Emu3VQVAEConfig` defaults,
  which are Emu3's); the tokenizer is the world's with Emu3's special tokens and one token per visual code, and the
  image area the processor's default (720 x 720 px: 90 x 90 codes, 8190 tokens with the row ends);
- lumina-mgpt-7b-768 (Alpha-VLLM/Lumina-mGPT-7B-768, fine-tuned from Chameleon-7B: transformers' Chameleon
  conversion of it): 32 layers x 4096, MLP 11008, 32 heads (query / key norms per head), vocabulary 65536, 4096
  positions, untied head; Chameleon's VQGAN at its official size (the `chameleon` preset: 8192 codes x 256, 16 pixels
  a code); 768 x 768 pixels: 48 rows of 48 codes + the row ends + `<eoss>`, 2353 generated tokens; the tokenizer is
  the world's with Lumina-mGPT's layout tokens and Chameleon's 8192 `IMGIMG*` image tokens;
- lumina-mgpt-2.0 (Alpha-VLLM/Lumina-mGPT-2.0, as Ascend MindSpeed-MM's port configures it,
  `examples/lumina/mgpt2/model.json`, and the official code's image ids 155000 + code): the same 32 x 4096 decoder
  with vocabulary 171385 and 10240 positions, 7.9B parameters; MoVQGAN 270M (16384 codes x 4, 8 pixels a code);
  768 x 768 pixels (its sample script's): 96 rows of 96 codes + the row ends + `<eoss>`, 9313 generated tokens; the
  world tokenizer with the layout tokens and 16384 `<MOVQGAN*` image tokens;
- every model: an EAGLE drafter (for eagle and lantern) of one decoder layer at the language model's width.
Weights are drawn by transformers' own initialisation directly in `dtype` on `device` (no float32 copy of a 7B
model), the language model's then scaled by `logit_scale` where asked (peaked laws, as a trained model's).
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.diffusers_folder import cast_like_loaded
from mmspec.errors import check

JANUS_TEXT = {  # size -> the language model's shape
    "janus-pro-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                         num_key_value_heads=16),
    "janus-pro-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=30, num_attention_heads=32,
                         num_key_value_heads=32),
}
JANUS_SIZES = tuple(JANUS_TEXT)
IMAGE_SIZE, IMAGE_TOKENS = 384, 576
EMU3_TEXT = {"emu3-gen": dict(vocab_size=184622, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=9216,
                              rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6})}
EMU3_SIZES = tuple(EMU3_TEXT)
EMU3_CODES = 32768
LUMINA_TEXT = {"lumina-mgpt-7b-768": dict(vocab_size=65536, hidden_size=4096, intermediate_size=11008,
                                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                          max_position_embeddings=4096, rms_norm_eps=1e-5),
               "lumina-mgpt-2.0": dict(vocab_size=171385, hidden_size=4096, intermediate_size=11008,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                       max_position_embeddings=10240, rms_norm_eps=1e-5)}
LUMINA_IMAGE_SIZE = {"lumina-mgpt-7b-768": 768, "lumina-mgpt-2.0": 768}  # 2.0: its sample script's size
LUMINA_SIZES = tuple(LUMINA_TEXT)


def janus_config(size: str, tokenizer, **text_overrides: Any):
    """The `JanusConfig` of `size` over `tokenizer`'s special ids (InputError naming the sizes otherwise)."""
    from transformers import JanusConfig

    check(size in JANUS_TEXT, f"unknown Janus size {size!r}; sizes: {', '.join(JANUS_SIZES)}.")
    width = JANUS_TEXT[size]["hidden_size"]
    text = dict(model_type="llama", vocab_size=102400, max_position_embeddings=16384, rms_norm_eps=1e-6,
                bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, **{**JANUS_TEXT[size], **text_overrides})
    return JanusConfig(text_config=text, vision_config=dict(image_size=IMAGE_SIZE, projection_dim=width, depth=2),
                       vq_config=dict(projection_dim=width, image_token_embed_dim=width, depth=2),
                       image_token_id=tokenizer.image_token_id, tie_word_embeddings=False)


def random_janus_pipeline(size: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                          seed: int = 0, logit_scale: float = 1.0, **text_overrides: Any):
    """A `JanusPipeline` over the random-weight Janus-Pro of `size` (see the module docstring); overrides change the
    language model's config (tests: fewer layers)."""
    from transformers import JanusForConditionalGeneration

    from image_ar.transformers_ar.pipeline import JanusPipeline
    from image_ar.transformers_ar.tiny import tiny_janus_processor

    check(logit_scale > 0, f"logit_scale must be > 0, got {logit_scale}.")
    processor = tiny_janus_processor(num_image_tokens=IMAGE_TOKENS, image_size=IMAGE_SIZE)
    tok = processor.tokenizer
    config = janus_config(size, tok, **text_overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = JanusForConditionalGeneration._from_config(config, dtype=dtype).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.model.generation_head.proj_out.weight.mul_(logit_scale)
    gen = model.generation_config  # as the official folders have it
    gen.bos_token_id, gen.pad_token_id = tok.bos_token_id, tok.pad_token_id
    gen.generation_kwargs = {"boi_token_id": tok.boi_token_id}
    gen.guidance_scale = 5.0
    return with_eagle_drafter(JanusPipeline(model, processor), device, dtype)


def random_emu3_pipeline(size: str = "emu3-gen", device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32, seed: int = 0, logit_scale: float = 1.0,
                         **text_overrides: Any):
    """An `Emu3Pipeline` over the random-weight Emu3 of `size` (see the module docstring); overrides change the
    language model's config (tests: fewer layers)."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3ImageProcessor, Emu3Processor

    from image_ar.transformers_ar.emu3 import EOL_TOKEN
    from image_ar.transformers_ar.pipeline import Emu3Pipeline
    from image_ar.transformers_ar.tiny import EMU3_TOKENS, world_tokenizer_with

    check(size in EMU3_TEXT, f"unknown Emu3 size {size!r}; sizes: {', '.join(EMU3_SIZES)}.")
    check(logit_scale > 0, f"logit_scale must be > 0, got {logit_scale}.")
    visual = [f"<|visual token{i:06d}|>" for i in range(EMU3_CODES)]
    tok = world_tokenizer_with(EMU3_TOKENS, [EOL_TOKEN, *visual])
    processor = Emu3Processor(image_processor=Emu3ImageProcessor(), tokenizer=tok)
    text = dict(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                **{**EMU3_TEXT[size], **text_overrides})
    config = Emu3Config(text_config=text, vq_config=dict(codebook_size=EMU3_CODES), vocabulary_map=tok.get_vocab())
    torch.manual_seed(seed)
    with torch.device(device):
        model = Emu3ForConditionalGeneration._from_config(config, dtype=dtype).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return with_eagle_drafter(Emu3Pipeline(model, processor), device, dtype)


def with_eagle_drafter(pipe, device: torch.device | str, dtype: torch.dtype):
    """`pipe` with a random EAGLE drafter (eagle and lantern's) of one decoder layer at its language model's width."""
    from image_ar.transformers_ar.eagle import ImageAREagleDrafter

    with torch.device(device):
        drafter = cast_like_loaded(ImageAREagleDrafter.for_target(pipe.lm), dtype).eval()
    pipe.eagle_drafter = drafter.attach(pipe.lm)
    return pipe


def random_lumina_mgpt_pipeline(size: str = "lumina-mgpt-7b-768", device: torch.device | str = "cpu",
                                dtype: torch.dtype = torch.float32, seed: int = 0, logit_scale: float = 1.0,
                                **text_overrides: Any):
    """A `LuminaMGPTPipeline` over the random-weight Lumina-mGPT of `size` (see the module docstring); overrides
    change the language model's config (tests: fewer layers)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    from image_ar.llamagen.vq import LlamaGenVQ
    from image_ar.movqgan import MoVQGAN
    from image_ar.transformers_ar.lumina_mgpt import SEPARATOR
    from image_ar.transformers_ar.lumina_pipeline import LuminaMGPTPipeline
    from image_ar.transformers_ar.tiny import lumina_tokenizer

    check(size in LUMINA_TEXT, f"unknown Lumina-mGPT size {size!r}; sizes: {', '.join(LUMINA_SIZES)}.")
    check(logit_scale > 0, f"logit_scale must be > 0, got {logit_scale}.")
    image_size, version = LUMINA_IMAGE_SIZE[size], 2 if size.endswith("-2.0") else 1
    tok = lumina_tokenizer(8192 if version == 1 else 16384, version, image_size // 32)
    text = dict(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.convert_tokens_to_ids(SEPARATOR), **{**LUMINA_TEXT[size], **text_overrides})
    config = ChameleonConfig(**text, vocabulary_map=tok.get_vocab(), tie_word_embeddings=False)
    config.lumina_mgpt = {"image_size": image_size, "version": version}
    torch.manual_seed(seed)
    with torch.device(device):
        model = ChameleonForConditionalGeneration._from_config(config, dtype=dtype).eval()
        vqgan = (LlamaGenVQ.from_preset("chameleon") if version == 1 else MoVQGAN()).to(dtype).eval()
    if version == 2:
        del model.model.vqmodel  # (2.0 has no Chameleon VQ-VAE; `LuminaMGPTPipeline.from_pretrained` drops it too)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return with_eagle_drafter(LuminaMGPTPipeline(model, tok, vqgan), device, dtype)
