"""SpecVLM (`vlm.specvlm`): the five compression primitives, the gate (hard in both modes, gradient in training),
the layout's true positions, and losslessness through the loop whatever primitive the gate picks."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import IMAGE_TOKEN, batch, greedy_vanilla_and_tree, prompt, tiny_llava

from vlm.specvlm import PRIMITIVES, VLMSpecVLMDrafter, VLMSpecVLMTreeDrafter, specvlm_layout
from vlm.target import LlavaCachedLM, prefill_vlm

ROWS = [prompt([7, 8, 20], [9], 16), prompt([12], [13, 30, 31, 32], 16), prompt([], [5], 16)]


def drafter_for(model) -> VLMSpecVLMDrafter:
    return VLMSpecVLMDrafter.for_target(LlavaCachedLM(model))


def test_primitives_shapes_and_pooling():
    drafter = drafter_for(tiny_llava())  # 4x4 image grid (16 tokens), ratio 4
    image = torch.randn(2, 16, 32)
    outs = drafter.compressor(image)
    assert [o.shape[1] for o in outs] == [4, 4, 4, 2, 0]
    grid = image.view(2, 4, 4, 32)
    torch.testing.assert_close(outs[1][:, 0], grid[:, :2, :2].mean((1, 2)))  # pool: top-left 2x2 block
    kept = image.norm(dim=-1).topk(4).indices.sort().values
    torch.testing.assert_close(outs[0], image.gather(1, kept.unsqueeze(-1).expand(-1, -1, 32)))


def test_gate_is_hard_and_trainable():
    drafter = drafter_for(tiny_llava())
    q = torch.randn(6, 32)
    hard = drafter.choose(q)
    assert torch.equal(hard.sum(-1), torch.ones(6)) and set(hard.unique().tolist()) <= {0.0, 1.0}
    weights = drafter.choose(q, torch.Generator().manual_seed(0), train=True)
    torch.testing.assert_close(weights.detach().sum(-1), torch.ones(6))
    weights[:, 0].sum().backward()  # straight-through: the gate receives a gradient
    assert drafter.gate[-1].weight.grad is not None and drafter.gate[-1].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("choice", range(len(PRIMITIVES)))
def test_layout_positions_for_every_primitive(choice):
    model = tiny_llava()
    lm = LlavaCachedLM(model)
    drafter = VLMSpecVLMDrafter.for_target(lm)
    with torch.no_grad():  # force the gate's choice
        drafter.gate[-1].weight.zero_()
        drafter.gate[-1].bias.zero_()
        drafter.gate[-1].bias[choice] = 10.0
    inputs = batch(ROWS[:2], torch.rand(2, 3, 32, 32))
    prefill_vlm(lm, inputs, 1)
    layout = specvlm_layout(drafter, inputs.input_ids, lm.prompt_embeds, lm.last_hidden, inputs.lengths,
                            inputs.lengths, IMAGE_TOKEN)
    k = drafter.compressor.sizes[choice]
    for r, row in enumerate(ROWS[:2]):
        s = row.index(IMAGE_TOKEN)
        e = s + 15
        expected = list(range(1, s)) + list(range(e - k + 1, e + 1)) + list(range(e + 1, len(row)))
        count = int(layout["count"][r])
        assert layout["positions"][r, :count].tolist() == expected
    assert layout["choice"].tolist() == [choice, choice]


@pytest.mark.parametrize("choice", [0, 3, 4])
def test_greedy_specvlm_equals_greedy_vanilla(choice):
    model = tiny_llava(seed=5)
    pixels = torch.rand(3, 3, 32, 32)
    lm = LlavaCachedLM(model)
    torch.manual_seed(0)
    drafter = VLMSpecVLMDrafter.for_target(lm)
    with torch.no_grad():
        drafter.gate[-1].bias[choice] = 50.0
    vanilla, spec = greedy_vanilla_and_tree(lm, VLMSpecVLMTreeDrafter, drafter, ROWS, pixels)
    assert torch.equal(spec.tokens, vanilla.tokens)
    assert drafter.last_choice.tolist() == [choice] * 3
