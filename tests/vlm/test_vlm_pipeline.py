"""`SpeculativeVLM` on a tiny world LLaVA and an untrained EagleVLM drafter: batched answers equal vanilla's at
temperature 0, rounds and streaming add up to the answers, folders round-trip, and bad input is a clear error.
(Every drafter kind's exactness and sampled law: the method contract, tests/test_contract.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from mmspec.data import generate_batch
from mmspec.errors import InputError
from vlm.eagle import VLMEagleDrafter
from vlm.pipeline import SpeculativeVLM
from vlm.target import LlavaCachedLM
from vlm.world import world_llava_config, world_processor

TINY = dict(vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
            text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2))


@pytest.fixture(scope="module")
def vlm() -> SpeculativeVLM:
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(world_llava_config(**TINY)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # a peaked next-token distribution (random tiny models are near uniform)
    drafter = VLMEagleDrafter.for_target(LlavaCachedLM(model))
    return SpeculativeVLM(model, world_processor(), drafter)


def world_images(n: int) -> list[torch.Tensor]:
    return list(generate_batch(n, seed=0, split="test").images)


QUESTIONS = ["What color is the object?", "Describe the image. Answer in detail.", "How many objects are there?"]


def test_greedy_answers_equal_vanilla_and_rounds_add_up(vlm):
    images = world_images(3)
    streamed = {i: "" for i in range(3)}

    def stream(row, text, ids):
        streamed[row] += text

    spec = vlm.generate(images, QUESTIONS, max_new_tokens=12, batch_size=2, tree=(3, 3, 8), stream=stream)
    vanilla = vlm.generate(images, QUESTIONS, max_new_tokens=12, batch_size=3, use_drafter=False)
    assert spec.token_ids == vanilla.token_ids and spec.texts == vanilla.texts
    assert spec.stats.num_drafts > 0 and vanilla.stats.num_drafts == 0
    for row in range(3):
        assert [t for r in spec.rounds[row] for t in r] == spec.token_ids[row]
        assert len(spec.rounds[row][0]) == 1  # the prefill's token
    quiet = vlm.generate(images, QUESTIONS, max_new_tokens=12, batch_size=2, tree=(3, 3, 8))
    assert quiet.rounds == spec.rounds  # without a stream the rounds are cut after the loop, the same way
    assert [len(r) for r in vanilla.rounds[0]] == [1] * len(vanilla.token_ids[0])
    tok = vlm.processor.tokenizer
    for row in range(3):  # streamed pieces add up to the answer, spaces included
        assert streamed[row].strip() == tok.decode(spec.token_ids[row], skip_special_tokens=True).strip()


def test_folder_round_trip(vlm, tmp_path):
    vlm.model.save_pretrained(tmp_path)
    vlm.processor.save_pretrained(tmp_path)
    vlm.drafter.save_pretrained(tmp_path / "drafters" / "eagle")
    again = SpeculativeVLM.from_pretrained(tmp_path, drafter="eagle")
    images = world_images(2)
    # budget="fixed": with "auto" the draft sizes depend on what each object learnt before and on timings
    a = vlm.generate(images, QUESTIONS[:2], max_new_tokens=6, tree=(3, 3, 8), budget="fixed")
    b = again.generate(images, QUESTIONS[:2], max_new_tokens=6, tree=(3, 3, 8), budget="fixed")
    assert a.token_ids == b.token_ids and a.stats.num_drafts == b.stats.num_drafts


def test_a_folder_in_another_parameter_layout_is_refused_not_loaded_half_random(vlm, tmp_path):
    """transformers leaves a parameter it cannot find at its random init and only logs it; a folder saved with
    another layout (a transformers release that renamed the vision tower's keys, say) must be an error."""
    from safetensors.torch import load_file, save_file

    vlm.model.save_pretrained(tmp_path)
    vlm.processor.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    renamed = {k.replace("vision_tower.", "vision_tower.old_layout."): v for k, v in weights.items()}
    assert renamed.keys() != weights.keys()
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"weights of LlavaForConditionalGeneration are not in .*another parameter "
                                         r"layout"):
        SpeculativeVLM.from_pretrained(tmp_path)


def test_bad_input(vlm, tmp_path):
    with pytest.raises(InputError, match="one image \\(a list for several, or None\\) per prompt"):
        vlm.generate(world_images(2), QUESTIONS[:1])
    with pytest.raises(InputError, match="non-empty"):
        vlm.generate(world_images(1), ["  "])
    with pytest.raises(InputError, match="tree must be"):
        vlm.generate(world_images(1), QUESTIONS[:1], tree=(3, 3))
    with pytest.raises(InputError, match="no VLM target"):
        SpeculativeVLM.from_pretrained(tmp_path)
    from vlm.pipeline import load_drafter

    with pytest.raises(InputError, match="unknown drafter kind"):
        load_drafter(tmp_path, "medusa")
    with pytest.raises(InputError, match="no eagle drafter"):
        load_drafter(tmp_path, "eagle")


def test_text_only_rows_mix_with_image_rows(vlm):
    """An image of None is a text-only row ("USER: {question} ASSISTANT:", no <image>); its answer is the target's
    own greedy answer to that text, in a batch with image rows; images=None makes every row text-only."""
    images = world_images(2)
    prompts = [QUESTIONS[0], "Say something.", QUESTIONS[1]]
    assert vlm.prompt_text(prompts[1], with_image=False) == "USER: Say something. ASSISTANT:"
    out = vlm.generate([images[0], None, images[1]], prompts, max_new_tokens=6, tree=(3, 3, 8), budget="fixed")
    alone = vlm.generate(None, prompts[1:2], max_new_tokens=6, use_drafter=False)
    assert out.token_ids[1] == alone.token_ids[0]
    assert out.token_ids[0] == vlm.generate(images[:1], prompts[:1], max_new_tokens=6, use_drafter=False).token_ids[0]
