"""`vlm.target`: the LLaVA target through mmspec's cache and loop equals transformers' own forward, token for
token in greedy decoding, for ragged batches (tiny random models built from configs)."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import assert_tree_logits_match_llava, batch, prompt, tiny_llava

from mmspec.errors import InputError
from mmspec.hf_cache import cache_argument
from mmspec.lm import LMTarget, NoDrafter
from mmspec.loop import generate
from mmspec.sampling import SamplingParams
from vlm.target import LlavaCachedLM, VLMInputs, prefill_vlm


def reference_greedy(model, row: list[int], pixels: torch.Tensor, steps: int) -> list[int]:
    """transformers' own forward with its own cache, one token at a time (the image only in the prompt, so a
    generated `<image>` id is an ordinary token, as in our loop)."""
    out = []
    name = cache_argument(model)  # `cache` from transformers 5.24 on (`past_key_values` warns, then goes in 5.40)
    with torch.no_grad():
        step = model(input_ids=torch.tensor([row]), pixel_values=pixels, use_cache=True)
        for _ in range(steps):
            token = int(step.logits[:, -1].argmax(-1))
            out.append(token)
            cache = step.get("cache", step.get("past_key_values"))
            step = model(input_ids=torch.tensor([[token]]), use_cache=True, **{name: cache})
    return out


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_prefill_logits_match_transformers(strategy):
    model = tiny_llava(strategy)
    n = 16 if strategy == "default" else 17
    rows = [prompt([7, 8], [9, 10, 11], n), prompt([12], [13], n)]
    pixels = torch.rand(2, 3, 32, 32)
    lm = LlavaCachedLM(model)
    cache, first = prefill_vlm(lm, batch(rows, pixels), extra_capacity=4)
    assert cache.lengths.tolist() == [len(r) for r in rows]
    with torch.no_grad():
        for i, r in enumerate(rows):
            ref = model(input_ids=torch.tensor([r]), pixel_values=pixels[i: i + 1]).logits  # [1, P, V]
            torch.testing.assert_close(first[i, 0], ref[0, -1].float(), atol=1e-5, rtol=1e-5)
            ours = lm.model.lm_head(lm.last_hidden[i: i + 1, : len(r)]).float()
            torch.testing.assert_close(ours, ref.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_loop_equals_transformers_greedy(batch_size):
    model = tiny_llava()
    rows = [prompt([7, 8, 20], [9], 16), prompt([12], [13, 30, 31, 32], 16), prompt([], [5], 16)][:batch_size]
    pixels = torch.rand(batch_size, 3, 32, 32)
    steps = 10
    target = LMTarget(LlavaCachedLM(model), SamplingParams(temperature=0.0), max_new_tokens=steps,
                      prefill_fn=prefill_vlm)
    out = generate(target, NoDrafter(), "greedy", batch(rows, pixels), batch_size=batch_size, max_new_tokens=steps)
    assert out.stats.num_target_forwards == steps
    for i, r in enumerate(rows):
        assert out.tokens[i].tolist() == reference_greedy(model, r, pixels[i: i + 1], steps)


def test_eos_stops_rows_independently():
    model = tiny_llava(seed=3)
    rows = [prompt([7], [9], 16), prompt([12, 14], [13], 16)]
    pixels = torch.rand(2, 3, 32, 32)
    free = [reference_greedy(model, r, pixels[i: i + 1], 8) for i, r in enumerate(rows)]
    eos = free[0][2]  # row 0 stops at its third token
    target = LMTarget(LlavaCachedLM(model), SamplingParams(temperature=0.0), max_new_tokens=8, prefill_fn=prefill_vlm)
    out = generate(target, NoDrafter(), "greedy", batch(rows, pixels), batch_size=2, max_new_tokens=8,
                   eos_token_id=eos)
    assert out.tokens[0, : out.num_generated[0]].tolist() == free[0][: free[0].index(eos) + 1]
    stop1 = free[1].index(eos) + 1 if eos in free[1] else 8
    assert out.tokens[1, : out.num_generated[1]].tolist() == free[1][:stop1]


def test_bad_inputs_are_clear_errors():
    lm = LlavaCachedLM(tiny_llava())
    with pytest.raises(InputError, match="right-padded"):
        VLMInputs(torch.tensor([[0, 1, 5]]), torch.tensor([[0, 1, 1]]))
    with pytest.raises(InputError, match="<image> tokens"):
        prefill_vlm(lm, batch([prompt([7], [8], 10)], torch.rand(1, 3, 32, 32)), 4)
    with pytest.raises(InputError, match="no pixel_values"):
        prefill_vlm(lm, batch([prompt([7], [8], 16)], None), 4)
    with pytest.raises(InputError, match="LlavaForConditionalGeneration"):
        LlavaCachedLM(torch.nn.Linear(2, 2))


def test_tree_verification_scores_every_path_like_transformers():
    """One verify forward over a draft tree (root = last token, two branches) gives at each node the logits
    transformers computes for the root-to-node path appended to the prompt."""
    model = tiny_llava(seed=1)
    rows = [prompt([7, 8], [9], 16), prompt([12], [13, 14, 15], 16)]
    pixels = torch.rand(2, 3, 32, 32)
    assert_tree_logits_match_llava(model, rows, pixels)


def test_targets_it_cannot_run_exactly_are_refused_in_one_line(tmp_path):
    """An unproven text backbone (OLMo) and InternVL (another architecture) are refused, naming what
    is supported, before any weights load."""
    from test_vlm_backbones import tiny_llava_with
    from transformers import OlmoConfig

    from vlm.pipeline import SpeculativeVLM

    small = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    olmo = tiny_llava_with(OlmoConfig(**small))
    with pytest.raises(InputError, match="'olmo' text backbone.*supports LlavaForConditionalGeneration"):
        LlavaCachedLM(olmo)
    folder = tmp_path / "olmo"
    olmo.save_pretrained(folder)
    (folder / "processor_config.json").write_text("{}")
    with pytest.raises(InputError, match="mmspec supports LlavaForConditionalGeneration") as err:
        SpeculativeVLM.from_pretrained(folder)
    assert "\n" not in str(err.value)
    (tmp_path / "internvl").mkdir()
    (tmp_path / "internvl" / "config.json").write_text('{"model_type": "internvl", "architectures": '
                                                       '["InternVLForConditionalGeneration"]}')
    (tmp_path / "internvl" / "processor_config.json").write_text("{}")
    with pytest.raises(InputError, match="'internvl' model \\(InternVLForConditionalGeneration\\)"):
        SpeculativeVLM.from_pretrained(tmp_path / "internvl")


def test_one_token_steps_without_a_mask_give_the_masked_logits():
    """`GuidedRunner.forward` passes mask None for one query per row when every row sits at the same slot (the
    target then hands transformers a zeros view instead of building the mask): the logits are the masked step's,
    bit for bit; rows at different slots still get the mask."""
    from mmspec.lm import GuidedRunner

    model = tiny_llava()
    rows = [prompt([7, 8], [9], 16), prompt([12], [13], 16)]
    lm = LlavaCachedLM(model)
    runner = GuidedRunner(lm, prefill_fn=prefill_vlm)
    runner.prefill(batch(rows, torch.rand(2, 3, 32, 32)), 8)
    seen = []
    forward = lm.forward_cached
    lm.forward_cached = lambda *args: seen.append(args[4]) or forward(*args)
    for lengths, unmasked in (([21, 21], True), ([21, 20], False)):
        runner.cache.lengths = torch.tensor(lengths)
        slots = runner.slots(1)  # [B, 1]
        tokens = torch.tensor([[30], [31]])
        got = runner.forward(tokens, slots, slots)
        assert (seen[-1] is None) == unmasked
        with runner.cache.keys_up_to(max(lengths) + 1):
            want = forward(tokens, slots, runner.cache, slots, runner.cache.attention_mask(slots))
        assert torch.equal(got, want)
