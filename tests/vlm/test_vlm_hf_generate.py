"""`SpeculativeVLM.generate(**processor_outputs, ...)` behaves like transformers' `model.generate`: the same
[B, P + N] tensor at greedy (left-padded processor batches, LLaVA and Qwen2-VL, vanilla and drafted), settings from
GenerationConfig, a transformers streamer, vLLM's speculation names, clear errors."""

from __future__ import annotations

from threading import Thread

import pytest
import torch
from transformers import GenerationConfig, TextIteratorStreamer

from mmspec.errors import InputError
from vlm.family import drafter_model
from vlm.tiny import tiny_processor_batch, tiny_vlm
from vlm.world import world_vqa_examples


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_greedy_tensor_equals_model_generate_on_a_left_padded_batch(family):
    vlm = tiny_vlm(family)
    enc = tiny_processor_batch(vlm)
    assert bool((enc["attention_mask"][:, 0] == 0).any())  # really left-padded
    reference = vlm.model.generate(**enc, max_new_tokens=10, do_sample=False)
    assert torch.equal(vlm.generate(**enc, max_new_tokens=10, do_sample=False), reference)
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    out = vlm.generate(**enc, max_new_tokens=10, do_sample=False, num_speculative_tokens=3, method="eagle",
                       return_dict_in_generate=True, budget="fixed")  # fixed: every step drafts its chain
    assert type(out) is type(vlm.model.generate(**enc, max_new_tokens=2, return_dict_in_generate=True))
    assert torch.equal(out.sequences, reference)
    assert vlm.last_stats.num_drafts > 0


def test_a_streamer_receives_the_answer():
    vlm = tiny_vlm("llava")
    vlm.drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    enc = tiny_processor_batch(vlm, n=1)
    streamer = TextIteratorStreamer(vlm.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    thread = Thread(target=lambda: result.update(out=vlm.generate(**enc, max_new_tokens=12, streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    new = result["out"][0, enc["input_ids"].shape[1]:]
    assert text.strip() == vlm.processor.tokenizer.decode(new, skip_special_tokens=True).strip()
    assert text.strip()


def test_settings_follow_transformers_precedence():
    """kwargs over generation_config over the model's generation config over transformers' defaults (the model's
    max_new_tokens; an unset max_length means 20 new tokens)."""
    vlm = tiny_vlm("llava")
    enc = tiny_processor_batch(vlm, n=2)
    p = enc["input_ids"].shape[1]
    model = vlm.model
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=7, repetition_penalty=1.5)
    for call in ({}, {"generation_config": GenerationConfig(max_new_tokens=5)}, {"max_new_tokens": 3},
                 {"generation_config": GenerationConfig(max_new_tokens=5, repetition_penalty=1.0)}):
        reference = model.generate(**enc, **call)
        assert torch.equal(vlm.generate(**enc, **call), reference)
    assert vlm.generate(**enc).shape[1] == p + 7
    model.generation_config = GenerationConfig()
    assert vlm.generate(**enc).shape[1] == p + 20  # transformers' default: 20 new tokens


def test_bad_calls_are_one_line_errors():
    vlm = tiny_vlm("llava")
    enc = tiny_processor_batch(vlm, n=2)
    examples = world_vqa_examples("test", 1, seed=0)
    cases = [
        (lambda: vlm.generate([examples[0].image], ["q"], **enc), "not both"),
        (lambda: vlm.generate(**enc, max_new_tokens=4, streamer=TextIteratorStreamer(vlm.processor.tokenizer)),
         "one row"),
        (lambda: vlm.generate(**enc, max_length=enc["input_ids"].shape[1]), "Input length of input_ids"),
        (lambda: vlm.generate(**enc, method="eagle"), "loaded drafter is none"),
        (lambda: vlm.generate(**enc, num_speculative_tokens=3, tree=(3, 2, 5)), "not both"),
        (lambda: vlm.generate([examples[0].image], ["q"], do_sample=True), "go with the processor's outputs"),
        (lambda: vlm.generate(**enc, stream=print), "transformers streamer"),
        (lambda: vlm.generate(**enc, generation_config=GenerationConfig(num_beams=4)), "beam search"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
