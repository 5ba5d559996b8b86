"""ViSpec (`vlm.vispec`): the short drafter layout (one compressed token per image run, true positions, global
feature on later text), its cached path against its training forward, and losslessness through the loop."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import IMAGE_TOKEN, batch, greedy_vanilla_and_tree, prompt, tiny_llava

from mmspec.lm import LMTarget
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams
from vlm.target import LlavaCachedLM, prefill_vlm
from vlm.vispec import VLMViSpecDrafter, VLMViSpecTreeDrafter, vispec_layout

ROWS = [prompt([7, 8, 20], [9], 16), prompt([12], [13, 30, 31, 32], 16), prompt([], [5], 16)]


def trained_looking(drafter: VLMViSpecDrafter) -> VLMViSpecDrafter:
    """Perturb img_fc away from its [I | 0] start so the global feature matters in the tests."""
    with torch.no_grad():
        drafter.img_fc.weight.add_(0.1 * torch.randn_like(drafter.img_fc.weight))
    return drafter


def test_img_fc_starts_as_identity_on_the_feature():
    lm = LlavaCachedLM(tiny_llava())
    drafter = VLMViSpecDrafter.for_target(lm)
    f, g = torch.randn(2, 3, 32), torch.randn(2, 32)
    torch.testing.assert_close(drafter.with_global(f, g), f)


def test_layout_keeps_true_positions():
    model = tiny_llava()
    lm = LlavaCachedLM(model)
    drafter = VLMViSpecDrafter.for_target(lm)
    rows = ROWS[:2]
    inputs = batch(rows, torch.rand(2, 3, 32, 32))
    prefill_vlm(lm, inputs, 1)
    layout = vispec_layout(drafter, inputs.input_ids, lm.prompt_embeds, lm.last_hidden, IMAGE_TOKEN)
    length = inputs.input_ids.shape[1]
    assert layout["positions"].shape == (2, length - 16)
    for b, r in enumerate(rows):
        s = r.index(IMAGE_TOKEN)
        e = s + 15
        expected = [i for i in range(1, length) if i < s or i >= e]
        assert layout["positions"][b].tolist() == expected  # the run collapses to its last position
    text_only = vispec_layout(drafter, inputs.input_ids, lm.prompt_embeds, lm.last_hidden, IMAGE_TOKEN,
                              text_only=True)
    assert text_only["positions"].shape == (2, length - 17)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_vispec_equals_greedy_vanilla(batch_size):
    model = tiny_llava(seed=5)
    rows, pixels = ROWS[:batch_size], torch.rand(batch_size, 3, 32, 32)
    lm = LlavaCachedLM(model)
    torch.manual_seed(0)
    drafter = trained_looking(VLMViSpecDrafter.for_target(lm))
    vanilla, spec = greedy_vanilla_and_tree(lm, VLMViSpecTreeDrafter, drafter, rows, pixels)
    assert torch.equal(spec.tokens, vanilla.tokens)
    assert spec.stats.num_drafts > 0


def test_cached_root_equals_the_layout_forward():
    """After begin, the drafter's output at the root pair equals its training forward over the layout of the prompt
    followed by the first generated token (compressed image, true positions, g on the text after it)."""
    model = tiny_llava(seed=2)
    lm = LlavaCachedLM(model)
    torch.manual_seed(1)
    drafter = trained_looking(VLMViSpecDrafter.for_target(lm))
    rows, pixels = ROWS[:2], torch.rand(2, 3, 32, 32)
    inputs = batch(rows, pixels)
    LMTarget(lm, SamplingParams(temperature=0.0), 4, prefill_fn=prefill_vlm).prefill(inputs)
    features, embeds = lm.last_hidden.clone(), lm.prompt_embeds.clone()
    tree = VLMViSpecTreeDrafter(drafter, lm, SamplingParams(temperature=0.0), top_k=2, depth=2, total_tokens=4)
    state = DecodeState.new(2, 4, "cpu")
    state.last_token = torch.tensor([40, 41])
    tree.begin(inputs, state)
    _, root_hidden, _ = tree.run_pending()
    for b, r in enumerate(rows):
        n = len(r)
        ids = torch.tensor([r + [int(state.last_token[b])]])
        seq_embeds = torch.cat([embeds[b: b + 1, :n], lm.text.embed_tokens(state.last_token[b: b + 1])[:, None]], 1)
        seq_features = torch.cat([features[b: b + 1, :n], torch.zeros(1, 1, 32)], 1)  # f_n is never read
        with torch.no_grad():
            layout = vispec_layout(drafter, ids, seq_embeds, seq_features, IMAGE_TOKEN)
            h = drafter(layout["embeds"], layout["features"], layout["positions"])
        torch.testing.assert_close(root_hidden[b], h[0, -1], atol=1e-5, rtol=1e-5)
