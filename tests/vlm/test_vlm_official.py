"""LLaVA targets at official sizes with random weights (`vlm.official`): the configurations (built on the meta
device), a shrunken one decoding under forced acceptance with each random drafter, and the bench options."""

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from mmspec.bench.registry import BenchSettings
from mmspec.errors import InputError
from mmspec.forced import AcceptanceProfile, Forcing
from vlm.bench import _options
from vlm.official import SIZES, official_config, random_drafters, random_vlm
from vlm.pipeline import SpeculativeVLM
from vlm.world import world_processor, world_vqa_examples

# transformers' config.json of each: LLaVA-1.5-7B 7.06B, 13B 13.35B; Qwen2-0.5B / 1.5B text models 0.49B / 1.54B
BILLIONS = {"llava-1.5-7b": (7.063, 6.739), "llava-1.5-13b": (13.351, 13.017), "llava-qwen2-0.5b": (0.799, 0.494),
            "llava-qwen2-1.5b": (1.851, 1.544)}


@pytest.mark.parametrize("size", SIZES)
def test_official_sizes_have_the_published_parameter_counts(size):
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(official_config(size, world_processor().tokenizer))
    total = sum(p.numel() for p in model.parameters()) / 1e9
    text = sum(p.numel() for p in model.model.language_model.parameters()) / 1e9
    text += 0 if model.config.tie_word_embeddings else model.lm_head.weight.numel() / 1e9
    assert (round(total, 3), round(text, 3)) == BILLIONS[size]
    assert model.config.image_seq_length == 576 and model.config.vision_config.image_size == 336


def test_an_unknown_size_is_a_one_line_error():
    with pytest.raises(InputError, match="sizes: llava-1.5-7b"):
        official_config("llava-70b", world_processor().tokenizer)


@pytest.fixture(scope="module")
def small():
    """llava-qwen2-0.5b with one-layer towers of width 64 (the official vocabulary and 576 image tokens)."""
    vlm = random_vlm("llava-qwen2-0.5b", vision_overrides=dict(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2),
                     hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
    return vlm, random_drafters(vlm)


@pytest.mark.parametrize("kind", ["eagle", "vispec", "msd"])
def test_random_drafters_decode_under_forced_acceptance(small, kind):
    vlm, drafters = small
    examples = world_vqa_examples("test", 2, seed=0, long_fraction=1.0)
    forcing = Forcing(profile=AcceptanceProfile((1.0,)))

    def answer(pipe):
        return pipe.generate([e.image for e in examples], [e.prompt for e in examples], 12, 0.0, 1.0,
                             tree=(None, None, None), batch_size=2, generator=torch.Generator().manual_seed(0),
                             use_drafter=pipe.drafter is not None, budget="fixed")

    with forcing.call([0, 1], record=True):
        reference = answer(vlm)
    with forcing.call([0, 1], kind, kind) as call:
        out = answer(SpeculativeVLM(vlm.model, vlm.processor, drafters[kind]))
    assert out.token_ids == reference.token_ids and call.rewrites > 0
    assert out.stats.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("options, says", [({"size": "llava-1.5-7b", "model": "x"}, "cannot go with model"),
                                           ({"fast": "yes"}, "unknown option")])
def test_bad_size_options_are_one_line_errors(options, says):
    with pytest.raises(InputError, match=says):
        _options(BenchSettings(options=options))
