"""`SpeculativeVLM.generate(**processor_outputs, ...)` behaves like transformers' `model.generate`: the same
[B, P + N] tensor at greedy (left-padded processor batches, LLaVA and Qwen2-VL, vanilla and drafted), settings from
GenerationConfig, a transformers streamer, vLLM's speculation names, clear errors."""

from __future__ import annotations

from threading import Thread

import pytest
import torch
from transformers import GenerationConfig, TextIteratorStreamer

from mmspec.errors import InputError
from mmspec.sampling import SamplingParams
from vlm.family import drafter_model
from vlm.hf_generate import resolve_generation
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
    assert torch.equal(out.sequences, reference)
    assert out.metrics["num_drafts"] > 0 and "mean_acceptance_length" in out.metrics
    assert not [k for k in out.metrics if k.startswith("_")]
    assert vlm.last_stats.num_drafts == out.metrics["num_drafts"]


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
    vlm = tiny_vlm("llava")
    model = vlm.model
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9,
                                               max_new_tokens=7, eos_token_id=[2, 3])
    assert resolve_generation(model, None, {}) == (SamplingParams(0.7, 5, 0.9), 7, [2, 3])
    assert resolve_generation(model, None, {"do_sample": False})[0] == SamplingParams(0.0)
    unset = GenerationConfig(do_sample=True)  # transformers' defaults for what is unset: temperature 1, top_k 50
    model.generation_config = unset
    assert resolve_generation(model, None, {})[0] == SamplingParams(1.0, 50, 1.0)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9,
                                               max_new_tokens=7, eos_token_id=[2, 3])
    given = GenerationConfig(do_sample=True, temperature=1.3, top_k=0, top_p=1.0)
    assert resolve_generation(model, given, {"top_k": 9})[0] == SamplingParams(1.3, 9, 1.0)
    enc = tiny_processor_batch(vlm, n=2)
    out = vlm.generate(**enc, do_sample=False)  # the model's max_new_tokens (7)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 7


def test_bad_calls_are_one_line_errors():
    vlm = tiny_vlm("llava")
    enc = tiny_processor_batch(vlm, n=2)
    examples = world_vqa_examples("test", 1, seed=0)
    cases = [
        (lambda: vlm.generate([examples[0].image], ["q"], **enc), "not both"),
        (lambda: vlm.generate(**enc, max_new_tokens=4, streamer=TextIteratorStreamer(vlm.processor.tokenizer)),
         "one row"),
        (lambda: vlm.generate(**enc), "no room for new tokens.*pass max_new_tokens"),
        (lambda: vlm.generate(**enc, method="eagle"), "loaded drafter is none"),
        (lambda: vlm.generate(**enc, num_speculative_tokens=3, tree=(3, 2, 5)), "not both"),
        (lambda: vlm.generate([examples[0].image], ["q"], do_sample=True), "go with the processor's outputs"),
        (lambda: vlm.generate(**enc, num_beams=4), "model inputs must be tensors"),
        (lambda: vlm.generate(**enc, generation_config=GenerationConfig(num_beams=4)), "beam search"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
