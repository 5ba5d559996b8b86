"""Every text backbone the LLaVA target accepts runs exactly: tiny random LLaVAs built from configs, greedy
vanilla and greedy tree drafting with each drafter kind == transformers' own `generate(do_sample=False)` token
for token on a ragged batch of 3; tree verification logits == transformers' forward of each root-to-node path;
an unproven backbone is refused in one line."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import assert_tree_logits_match_llava, greedy_vanilla_and_tree, prompt

from mmspec.errors import InputError
from vlm.family import DRAFTER_KINDS, drafter_model
from vlm.target import SUPPORTED_TEXT_MODELS, LlavaCachedLM
from vlm.tiny import tiny_text_config

SMALL = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def text_config(backbone: str):
    """A tiny text config of `backbone` over this module's 99-token vocabulary (`vlm.tiny.tiny_text_config`)."""
    return tiny_text_config(backbone, vocab_size=99)


def tiny_llava_with(text, seed: int = 0, **kwargs):
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=4,
                                                      image_seq_length=16, **kwargs)).eval()
    with torch.no_grad():  # random init leaves some norms at exactly 0 / 1; perturb so every module matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def transformers_greedy(model, rows: list[list[int]], pixels: torch.Tensor, steps: int) -> list[list[int]]:
    """transformers' own `generate(do_sample=False)` for each row alone (no padding, no EOS stop)."""
    out = []
    for i, r in enumerate(rows):
        ids = torch.tensor([r])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels[i: i + 1],
                             max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(r):].tolist())
    return out


ROWS = [prompt([7, 8, 20], [9], 16), prompt([12], [13, 30, 31, 32], 16), prompt([], [5], 16)]


@pytest.mark.parametrize("backbone", SUPPORTED_TEXT_MODELS)
def test_greedy_vanilla_and_every_drafter_equal_transformers_generate(backbone):
    model = tiny_llava_with(text_config(backbone))
    pixels = torch.rand(3, 3, 32, 32)
    steps = 10
    reference = transformers_greedy(model, ROWS, pixels, steps)
    lm = LlavaCachedLM(model)
    for kind in DRAFTER_KINDS:
        torch.manual_seed(1)
        drafter = drafter_model(kind).for_target(lm).eval()
        vanilla, spec = greedy_vanilla_and_tree(lm, drafter.loop_drafter, drafter, ROWS, pixels, steps)
        for i in range(3):
            assert vanilla.tokens[i].tolist() == reference[i], (kind, i)
            assert spec.tokens[i].tolist() == reference[i], (kind, i)


@pytest.mark.parametrize("backbone", ["qwen3", "gemma3_text"])
def test_tree_verification_equals_transformers_forward_of_each_path(backbone):
    model = tiny_llava_with(text_config(backbone), seed=2)
    rows = ROWS[:2]
    pixels = torch.rand(2, 3, 32, 32)
    assert_tree_logits_match_llava(model, rows, pixels)


def test_an_unproven_backbone_and_flash_attention_are_refused_in_one_line():
    from transformers import OlmoConfig

    with pytest.raises(InputError, match="'olmo' text backbone.*supports LlavaForConditionalGeneration") as err:
        LlavaCachedLM(tiny_llava_with(OlmoConfig(**SMALL)))
    assert "\n" not in str(err.value)
    model = tiny_llava_with(text_config("llama"))
    model.model.language_model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(InputError, match="cannot apply a tree mask; load it with attn_implementation='sdpa'"):
        LlavaCachedLM(model)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_mmspec_attention_backend_equals_the_models_own(backend):
    """`attention_backend` routes the model's attention through mmspec's backends: same greedy tokens."""
    model = tiny_llava_with(text_config("qwen3"))
    pixels = torch.rand(3, 3, 32, 32)
    reference = transformers_greedy(model, ROWS, pixels, 8)
    lm = LlavaCachedLM(model, attention_backend=backend)
    drafter = drafter_model("eagle").for_target(lm).eval()
    vanilla, spec = greedy_vanilla_and_tree(lm, drafter.loop_drafter, drafter, ROWS, pixels, 8)
    assert [t.tolist() for t in vanilla.tokens] == reference == [t.tolist() for t in spec.tokens]
    assert model.model.language_model.config._attn_implementation != "mmspec"  # restored after each call


def test_soft_capped_attention_refuses_an_mmspec_backend_at_once():
    model = tiny_llava_with(text_config("gemma2"))
    with pytest.raises(InputError, match="soft-caps its attention logits.*leave attention_backend unset"):
        LlavaCachedLM(model, attention_backend="sdpa")
    LlavaCachedLM(model)  # its own (eager) attention is fine: exact in the greedy test above


def test_mistral_runs_through_an_mmspec_backend_inside_its_window():
    model = tiny_llava_with(text_config("mistral"))
    pixels = torch.rand(3, 3, 32, 32)
    lm = LlavaCachedLM(model, attention_backend="eager")
    drafter = drafter_model("msd").for_target(lm).eval()
    vanilla, spec = greedy_vanilla_and_tree(lm, drafter.loop_drafter, drafter, ROWS, pixels, 6)
    assert [t.tolist() for t in spec.tokens] == transformers_greedy(model, ROWS, pixels, 6)


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_text_only_rows_mix_with_image_rows_for_every_drafter(kind):
    """A batch whose middle row has no image (pixel_values holds the other rows' images, in row order)."""
    from vlm_dummies import IMAGE_TOKEN

    model = tiny_llava_with(text_config("llama"), seed=4)
    rows = [ROWS[0], [1, 7, 8, 9, 10, 11], ROWS[2]]
    pixels = torch.rand(2, 3, 32, 32)
    lm = LlavaCachedLM(model)
    drafter = drafter_model(kind).for_target(lm).eval()
    vanilla, spec = greedy_vanilla_and_tree(lm, drafter.loop_drafter, drafter, rows, pixels, 8)
    reference = [transformers_greedy(model, [rows[0]], pixels[:1], 8)[0],
                 model.generate(input_ids=torch.tensor([rows[1]]), max_new_tokens=8, min_new_tokens=8,
                                do_sample=False, pad_token_id=0)[0, len(rows[1]):].tolist(),
                 transformers_greedy(model, [rows[2]], pixels[1:], 8)[0]]
    assert IMAGE_TOKEN not in rows[1]
    assert [t.tolist() for t in vanilla.tokens] == reference == [t.tolist() for t in spec.tokens]


@pytest.mark.parametrize("backbone", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_window_backbones_stay_exact_past_their_window(backbone):
    """A window of 12 tokens under prompts of 18-23 tokens and 16 new ones: greedy vanilla and EAGLE trees ==
    transformers' own generate (the window applied by sequence index, per layer type); the same target run with
    full attention answers differently, so the window is what makes them equal."""
    text = text_config(backbone)
    text.sliding_window = 12
    model = tiny_llava_with(text, seed=3)
    pixels = torch.rand(3, 3, 32, 32)
    steps = 16
    reference = transformers_greedy(model, ROWS, pixels, steps)
    lm = LlavaCachedLM(model)
    assert lm.window == 12
    torch.manual_seed(1)
    drafter = drafter_model("eagle").for_target(lm).eval()
    vanilla, spec = greedy_vanilla_and_tree(lm, drafter.loop_drafter, drafter, ROWS, pixels, steps)
    assert [t.tolist() for t in vanilla.tokens] == reference == [t.tolist() for t in spec.tokens]
    lm.window = None  # full attention everywhere
    full, _ = greedy_vanilla_and_tree(lm, drafter.loop_drafter, drafter, ROWS, pixels, steps)
    assert [t.tolist() for t in full.tokens] != reference
