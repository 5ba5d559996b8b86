"""Janus-Pro, Emu3 and Lumina-mGPT at their official sizes (random weights): the configurations of
deepseek-ai/Janus-Pro-1B and -7B, BAAI/Emu3-Gen and Alpha-VLLM/Lumina-mGPT-7B-768, the parameter counts they give,
and the bench options that build them (`image_ar.transformers_ar.official`)."""

from __future__ import annotations

import pytest
import torch

from image_ar.transformers_ar.official import (
    JANUS_SIZES,
    random_emu3_pipeline,
    random_janus_pipeline,
    random_lumina_mgpt_pipeline,
)
from mmspec.bench.registry import BenchSettings
from mmspec.errors import InputError

# (layers, width, parameters without the EAGLE drafter: the checkpoints' listed 2.09B and 7.42B, within 1%)
SHAPES = {"janus-pro-1b": (24, 2048, 2.09e9), "janus-pro-7b": (30, 4096, 7.42e9)}


@pytest.mark.parametrize("size", JANUS_SIZES)
def test_official_shapes_and_parameter_counts(size):
    pipe = random_janus_pipeline(size, device="meta", dtype=torch.bfloat16)
    model = pipe.model
    layers, width, published = SHAPES[size]
    text = model.config.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == (layers, width, 102400)
    assert model.config.vision_config.num_image_tokens == 576 and pipe.image_token_layout() == (576, 24, 16384)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / published - 1) < 0.01, count
    assert model.lm_head.weight.dtype == torch.bfloat16 and not model.config.tie_word_embeddings
    drafter = pipe.eagle_drafter
    assert drafter is not None and drafter.config.hidden_size == width  # EAGLE's one layer at the target's width


def test_bench_options():
    from image_ar.transformers_ar.bench import _options

    assert _options(BenchSettings(options={"size": "janus-pro-1b"}), "janus")["size"] == "janus-pro-1b"
    with pytest.raises(InputError, match="needs --family-option model=FOLDER .* or size=janus-pro-1b"):
        _options(BenchSettings(options={}), "janus")
    assert _options(BenchSettings(options={"size": "emu3-gen"}), "emu3")["size"] == "emu3-gen"
    with pytest.raises(InputError, match="logit_scale must be a positive number"):
        _options(BenchSettings(options={"size": "janus-pro-1b", "logit_scale": "-2"}), "janus")
    with pytest.raises(InputError, match="unknown Janus size 'janus-9b'"):
        random_janus_pipeline("janus-9b", device="meta")


def test_emu3_gen_shapes():
    pipe = random_emu3_pipeline("emu3-gen", device="meta", dtype=torch.bfloat16)
    text = pipe.model.config.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_key_value_heads, text.vocab_size) == (32, 4096, 8,
                                                                                                     184622)
    assert pipe.model.config.vq_config.codebook_size == 32768 and pipe.lm.vocab_size == 184622
    text_count = sum(p.numel() for p in (*pipe.model.model.text_model.parameters(), pipe.model.lm_head.weight))
    assert abs(text_count / 8.49e9 - 1) < 0.005, text_count  # the language model, untied head included
    vq_count = sum(p.numel() for p in pipe.model.model.vqmodel.parameters())
    assert 0.2e9 < vq_count < 0.35e9, vq_count  # the MoVQGAN tokenizer
    assert pipe.eagle_drafter.config.hidden_size == 4096


def test_lumina_mgpt_7b_768_shapes():
    pipe = random_lumina_mgpt_pipeline("lumina-mgpt-7b-768", device="meta", dtype=torch.bfloat16)
    config = pipe.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.model_parallel_size) == (
        32, 4096, 65536, 1)
    text_count = sum(p.numel() for n, p in pipe.model.named_parameters() if not n.startswith("model.vqmodel."))
    assert abs(text_count / 7.01e9 - 1) < 0.005, text_count  # Chameleon-7B: 32 x (4 x 4096^2 + 3 x 4096 x 11008)
    assert pipe.default_image_size == 768 and len(pipe.special.visual) == 8192
    pipe.grid = (48, 48)
    assert pipe.image_token_layout() == (48 * 49 + 1, 49, 65536)  # 2353 generated tokens a 768-px image
    vq_count = sum(p.numel() for p in pipe.vqgan.parameters())
    assert 60e6 < vq_count < 80e6, vq_count  # taming's VQModel at ch 128 (no level attention)
    assert pipe.vqgan.config.codebook_size == 8192 and pipe.eagle_drafter.config.hidden_size == 4096


def test_lumina_mgpt_2_shapes():
    pipe = random_lumina_mgpt_pipeline("lumina-mgpt-2.0", device="meta", dtype=torch.bfloat16)
    config = pipe.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (32, 4096, 171385)
    count = sum(p.numel() for p in pipe.model.parameters())
    assert abs(count / 7.88e9 - 1) < 0.005, count  # 6.48B of layers + two 171385 x 4096 tables
    assert pipe.version == 2 and pipe.codes_per_unit == 4 and not hasattr(pipe.model.model, "vqmodel")
    pipe.grid = (96, 96)
    assert pipe.image_token_layout() == (96 * 97 + 1, 97, 171385)  # 9313 generated tokens a 768-px image
    vq_count = sum(p.numel() for p in pipe.vqgan.parameters())
    assert 0.2e9 < vq_count < 0.35e9, vq_count  # MoVQGAN "270M"
    assert pipe.vqgan.config.codebook_size == 16384 and pipe.default_top_k == 4096
