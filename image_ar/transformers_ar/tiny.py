"""Tiny random Janus, Emu3 and Lumina-mGPT models with their own processors, built offline: for tests, docs examples
and the CLI.

    pipe = tiny_janus_pipeline()                    # JanusForConditionalGeneration + JanusProcessor, seeded
    pipe.save_pretrained("tiny-janus")              # transformers' own layout
    #   mmspec generate --family janus --model tiny-janus --prompt "a red circle" --method sjd --out out/
    emu3 = tiny_emu3_pipeline()                     # Emu3ForConditionalGeneration + Emu3Processor
    lumina = tiny_lumina_mgpt_pipeline()            # ChameleonForConditionalGeneration + tokenizer + VQGAN
    lumina2 = tiny_lumina_mgpt_pipeline(version=2)  # the same with Lumina-mGPT 2.0's token names and a MoVQGAN

The text side is the embedded world's tokenizer plus each model's special tokens (Janus: image start / end / image
tokens and a chat template shaped like Janus-Pro's; Emu3: its image-start / end, image-wrapper, end-of-line and
end-of-frame tokens and one token per visual code, named as its vocabulary map wants); the models are 2 text layers
of width 32 (Janus: a 64-code VQ, 4 x 4 tokens, 16 x 16 pixels; Emu3: a 16-code VQ, 4 x 4 tokens at
image_area=1024, 8 x 8 pixels). The weights are random: the images are noise, but every code path is the real one.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

IMAGE_TOKENS = {"boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_placeholder>"}
CHAT_TEMPLATE = ("{% for message in messages %}<|User|>: {% for part in message['content'] %}{{ part['text'] }}"
                 "{% endfor %}\n\n{% endfor %}{% if add_generation_prompt %}<|Assistant|>:{% endif %}")


def world_tokenizer_with(named: dict[str, str], extra: list[str]):
    """The world tokenizer plus `named` special tokens (set as tokenizer attributes, e.g. boi_token, through
    tokenizer_config's extra_special_tokens, as real folders name them) and `extra` ones; left padding."""
    import transformers as tf

    from mmspec.data import load_world_tokenizer

    tok = load_world_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [*named.values(), *extra]})
    with tempfile.TemporaryDirectory() as folder:
        tok.save_pretrained(folder)
        path = Path(folder, "tokenizer_config.json")
        path.write_text(json.dumps({**json.loads(path.read_text()), "extra_special_tokens": named}))
        tok = tf.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    return tok


def tiny_janus_processor(num_image_tokens: int = 16, image_size: int = 16):
    """A JanusProcessor over the world tokenizer with Janus's image tokens (left padding, as the official one)."""
    import transformers as tf

    tok = world_tokenizer_with(IMAGE_TOKENS, ["<|User|>", "<|Assistant|>"])
    images = tf.JanusImageProcessor(size={"height": image_size, "width": image_size})
    return tf.JanusProcessor(image_processor=images, tokenizer=tok, chat_template=CHAT_TEMPLATE,
                             num_image_tokens=num_image_tokens)


def tiny_janus_model(vocab_size: int, boi_token_id: int, image_token_id: int, bos_token_id: int,
                     pad_token_id: int, seed: int = 0, scale: float = 4.0):
    """A random JanusForConditionalGeneration (64 codes, 16 image tokens), its weights scaled by `scale` so the
    laws over codes are peaked (drafts then get accepted); generation_config as the official folders have it."""
    import transformers as tf

    config = tf.JanusConfig(
        text_config=dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=bos_token_id, pad_token_id=pad_token_id),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=4,
                           num_image_tokens=16, projection_dim=32, intermediate_size=64),
        vq_config=dict(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 1, 2], num_res_blocks=1, projection_dim=32, image_token_embed_dim=32,
                       num_patches=4),
        image_token_id=image_token_id)
    torch.manual_seed(seed)
    model = tf.JanusForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.language_model.parameters():
            p.mul_(scale)
        for p in (*model.model.generation_head.parameters(), *model.model.generation_embeddings.parameters()):
            p.mul_(scale)
    gen = model.generation_config
    gen.bos_token_id, gen.pad_token_id = bos_token_id, pad_token_id
    gen.generation_kwargs = {"boi_token_id": boi_token_id}
    gen.guidance_scale = 5.0
    return model


def tiny_janus_pipeline(seed: int = 0):
    """A `JanusPipeline` of the tiny random model and its processor."""
    from image_ar.transformers_ar.pipeline import JanusPipeline

    processor = tiny_janus_processor()
    tok = processor.tokenizer
    model = tiny_janus_model(len(tok), tok.boi_token_id, tok.image_token_id, tok.bos_token_id, tok.pad_token_id,
                             seed)
    return JanusPipeline(model, processor)


EMU3_TOKENS = {"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
               "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"}
EMU3_CODES = 16


def tiny_emu3_pipeline(seed: int = 0, scale: float = 3.0):
    """An `Emu3Pipeline` of a random Emu3ForConditionalGeneration (weights of the language model scaled by `scale`:
    peaked laws) and its Emu3Processor (image_area 1024 -> a 4 x 4 token grid)."""
    import transformers as tf

    from image_ar.transformers_ar.emu3 import EOL_TOKEN
    from image_ar.transformers_ar.pipeline import Emu3Pipeline

    visual = [f"<|visual token{i:06d}|>" for i in range(EMU3_CODES)]
    tok = world_tokenizer_with(EMU3_TOKENS, [EOL_TOKEN, *visual])
    processor = tf.Emu3Processor(image_processor=tf.Emu3ImageProcessor(), tokenizer=tok)
    config = tf.Emu3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id),
        vq_config=dict(codebook_size=EMU3_CODES, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 1], attn_resolutions=[], temporal_downsample_factor=2,
                       num_res_blocks=1, hidden_size=32, num_attention_heads=1),
        vocabulary_map=tok.get_vocab())
    torch.manual_seed(seed)
    model = tf.Emu3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in (*model.model.text_model.parameters(), model.lm_head.weight):
            p.mul_(scale)
    model.generation_config.image_area = 32 * 32  # Emu3Pipeline's default area (the processor's is 518400)
    model.generation_config._from_model_config = False  # saved as the folder's own (transformers re-derives others)
    return Emu3Pipeline(model, processor)


LUMINA_CODES = 64


def image_token_name(code: int) -> str:
    """Chameleon's name of VQ code `code` in its vocabulary (`IMGIMG` + the digits as letters A-J + `Z`)."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def lumina_tokenizer(codes: int, version: int = 1, units: int = 4):
    """The world tokenizer with Lumina-mGPT's layout tokens, grid tokens for 1..`units` 32-pixel units and `codes`
    image tokens (version 1: Chameleon's `IMGIMG*` names; 2: Lumina-mGPT 2.0's `<MOVQGAN*`), right padding."""
    from image_ar.transformers_ar.lumina_mgpt import (
        IMAGE_END,
        IMAGE_START,
        MOVQGAN_PREFIX,
        NEW_LINE,
        SEPARATOR,
        grid_token,
    )

    names = [image_token_name(c) if version == 1 else f"{MOVQGAN_PREFIX}{c:05d}>" for c in range(codes)]
    tok = world_tokenizer_with({}, [IMAGE_START, IMAGE_END, NEW_LINE, SEPARATOR,
                                    *(grid_token(n) for n in range(1, units + 1)), *names])
    tok.padding_side = "right"
    return tok


def tiny_lumina_mgpt_pipeline(seed: int = 0, scale: float = 3.0, version: int = 1, swin_norm: bool = False):
    """A `LuminaMGPTPipeline` of a random transformers Chameleon (its language model scaled by `scale`: peaked laws)
    over the world tokenizer with Lumina-mGPT's layout tokens, grid tokens for 32-128 pixels and 64 image tokens, and
    a random image tokenizer of 64 codes. version 1: Chameleon's `IMGIMG*` token names and a Chameleon-shaped VQGAN
    (ch 32, codes of 8, 16 pixels a code), 64 x 64 pixels by default (a 4 x 4 grid); version 2: Lumina-mGPT 2.0's
    `<MOVQGAN*` names and a MoVQGAN (ch 32, codes of 4, 8 pixels a code), 32 x 32 by default (4 x 4). Either way
    21 generated tokens an image with the row ends and `<eoss>`. `swin_norm`: Chameleon-34B's (Lumina-mGPT-34B's)
    norms after attention and MLP instead of before."""
    import transformers as tf

    from image_ar.llamagen.vq import LlamaGenVQ
    from image_ar.movqgan import MoVQGAN
    from image_ar.transformers_ar.lumina_mgpt import SEPARATOR
    from image_ar.transformers_ar.lumina_pipeline import LuminaMGPTPipeline

    tok = lumina_tokenizer(LUMINA_CODES, version)
    torch.manual_seed(seed)
    if version == 1:
        vqgan = LlamaGenVQ.from_preset("chameleon", ch=32, num_res_blocks=1, z_channels=32,
                                       codebook_size=LUMINA_CODES, codebook_embed_dim=8).eval()
    else:
        vqgan = MoVQGAN(codebook_size=LUMINA_CODES, ch=32, num_res_blocks=1).eval()
    config = tf.ChameleonConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids(SEPARATOR),
        vocabulary_map=tok.get_vocab(), swin_norm=swin_norm,
        vq_config=dict(embed_dim=8, num_embeddings=LUMINA_CODES, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 1, 2, 2, 4], num_res_blocks=1))
    config.lumina_mgpt = {"image_size": 64 if version == 1 else 32, "version": version}
    model = tf.ChameleonForConditionalGeneration(config).eval()
    if version == 2:
        del model.model.vqmodel  # 2.0 has no Chameleon VQ-VAE (what LuminaMGPTPipeline.from_pretrained does)
    with torch.no_grad():
        for p in (*model.model.layers.parameters(), model.lm_head.weight):
            p.mul_(scale)
    return LuminaMGPTPipeline(model, tok, vqgan)


TINY = {"janus": tiny_janus_pipeline, "emu3": tiny_emu3_pipeline, "lumina-mgpt": tiny_lumina_mgpt_pipeline,
        "lumina-mgpt-2": lambda: tiny_lumina_mgpt_pipeline(version=2)}


def main(argv: list[str] | None = None) -> int:
    """python -m image_ar.transformers_ar.tiny FOLDER [--model janus|emu3|lumina-mgpt]: write a tiny random model
    folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m image_ar.transformers_ar.tiny",
                                     description="write a tiny random Janus, Emu3 or Lumina-mGPT folder in "
                                                 "transformers' layout")
    parser.add_argument("folder")
    parser.add_argument("--model", choices=tuple(TINY), default="janus")
    args = parser.parse_args(argv)
    pipe = TINY[args.model]()
    pipe.save_pretrained(args.folder)
    print(f"wrote {args.folder} (a tiny random {args.model} in transformers' layout)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
