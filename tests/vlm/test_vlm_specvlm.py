"""SpecVLM (`vlm.specvlm`): the five compression primitives, the gate (hard in both modes, gradient in training),
the layout's true positions, and losslessness through the loop whatever primitive the gate picks."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import IMAGE_TOKEN, batch, greedy_vanilla_and_tree, prompt, tiny_llava

from mmspec.phases import record_phases
from vlm.specvlm import PRIMITIVES, VLMSpecVLMDrafter, VLMSpecVLMTreeDrafter, specvlm_layout
from vlm.target import LlavaCachedLM, prefill_vlm, square_grid

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


def test_pooling_on_rectangles_with_partial_windows_and_row_strides():
    """A 3 x 5 grid whose lines are followed by a newline token (stride 6), after a 2 x 2 square: pool averages each
    2 x 2 window over the tokens it covers (a border window covers fewer), conv sees zeros past the border, and
    neither reads the newline tokens; prune keeps ceil(T / 4) tokens."""
    compressor = drafter_for(tiny_llava()).compressor
    image = torch.randn(2, 4 + 18, 32)  # [N, T, H]
    grids = [(0, 2, 2, 2), (4, 3, 5, 6)]
    outs = compressor(image, grids)
    assert [o.shape[1] for o in outs] == [6, 1 + 2 * 3, 1 + 2 * 3, 2, 0]
    assert compressor.sizes(22, grids) == [o.shape[1] for o in outs]
    tiles = image[:, 4:].view(2, 3, 6, 32)[:, :, :5]  # [N, 3, 5, H] without the newline column
    torch.testing.assert_close(outs[1][:, 0], image[:, :4].mean(1))
    torch.testing.assert_close(outs[1][:, 1], tiles[:, :2, :2].mean((1, 2)))
    torch.testing.assert_close(outs[1][:, 3], tiles[:, :2, 4].mean(1))  # right border: one column
    torch.testing.assert_close(outs[1][:, 6], tiles[:, 2, 4])  # corner: one token
    conv = compressor.conv
    corner = torch.einsum("nh,oh->no", tiles[:, 2, 4], conv.weight[:, :, 0, 0]) + conv.bias
    torch.testing.assert_close(outs[2][:, 6], corner, atol=1e-5, rtol=1e-5)
    image[:, 4 + 5::6] = 1e6  # the newline tokens do not enter pool or conv
    assert torch.equal(compressor(image, grids)[1], outs[1]) and torch.equal(compressor(image, grids)[2], outs[2])


def test_runs_of_different_lengths_compress_as_each_alone():
    drafter = drafter_for(tiny_llava())
    runs = [torch.randn(16, 32), torch.randn(6, 32), torch.randn(16, 32)]
    grids = [None, [(0, 2, 3, 3)], None]
    weights = torch.nn.functional.one_hot(torch.tensor([1, 2, 0]), len(PRIMITIVES)).float()
    tokens, counts = drafter.compress(runs, grids, weights)
    assert counts.tolist() == [4, 2, 4]
    for n in range(3):
        alone, count = drafter.compress(runs[n: n + 1], grids[n: n + 1], weights[n: n + 1])
        torch.testing.assert_close(tokens[n, :count], alone[0, :count])


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
    k = drafter.compressor.sizes(16, square_grid(4))[choice]
    for r, row in enumerate(ROWS[:2]):
        s = row.index(IMAGE_TOKEN)
        e = s + 15
        expected = list(range(1, s)) + list(range(e - k + 1, e + 1)) + list(range(e + 1, len(row)))
        count = int(layout["count"][r])
        assert layout["positions"][r, :count].tolist() == expected
    assert layout["choice"].tolist() == [choice, choice]


def test_the_layout_reads_the_device_a_fixed_number_of_times():
    """The layout is index bookkeeping on the host: each row's bounds are read in one transfer, never row by row
    or position by position (each read of a CUDA value waits for the device: SpecVLM's begin at batch 32 on an
    H200 took 33-43 ms before, 8-10 ms after, 2026-11-28)."""
    model = tiny_llava()
    lm = LlavaCachedLM(model)
    drafter = VLMSpecVLMDrafter.for_target(lm)
    reads = []
    for rows in (ROWS[:1], ROWS + [prompt([7, 8], [9, 5, 5], 0)]):  # a text-only row mixed in
        inputs = batch(rows, torch.rand(min(len(rows), 3), 3, 32, 32))
        prefill_vlm(lm, inputs, 1)
        with record_phases(count_ops=True) as times:
            layout = specvlm_layout(drafter, inputs.input_ids, lm.prompt_embeds, lm.last_hidden, inputs.lengths,
                                    inputs.lengths, IMAGE_TOKEN)
        reads.append(sum(times.syncs.values()))
    assert reads[0] == reads[1] <= 5  # the gate, compressor and bounds checks: as many for one row as for four
    assert layout["kept"][-1] == 0 and layout["count"][-1] == len(rows[-1]) - 1  # the text-only row: every pair

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


def test_a_prompt_with_two_images_is_refused_in_one_line():
    from mmspec.errors import InputError

    lm = LlavaCachedLM(tiny_llava())
    two = prompt([7], [9], 16) + [IMAGE_TOKEN] * 16 + [5]
    inputs = batch([two, ROWS[1]], torch.rand(3, 3, 32, 32))
    prefill_vlm(lm, inputs, 1)
    with pytest.raises(InputError, match="one image per prompt") as err:
        specvlm_layout(drafter_for(lm.model), inputs.input_ids, lm.prompt_embeds, lm.last_hidden, inputs.lengths,
                       inputs.lengths, IMAGE_TOKEN)
    assert "\n" not in str(err.value)


def test_full_feature_selection_pools_the_grid_after_the_class_token():
    """LLaVA with vision_feature_select_strategy="full": 17 tokens per image, CLIP's class token first, then the
    4 x 4 grid that pool and conv work on; greedy SpecVLM with pooling == greedy vanilla."""
    model = tiny_llava("full", seed=5)
    lm = LlavaCachedLM(model)
    assert lm.fixed_square_grid() == [(1, 4, 4, 4)]
    torch.manual_seed(0)
    drafter = VLMSpecVLMDrafter.for_target(lm)
    with torch.no_grad():
        drafter.gate[-1].bias[PRIMITIVES.index("pool")] = 50.0
    rows = [prompt([7, 8, 20], [9], 17), prompt([12], [13, 30, 31, 32], 17)]
    vanilla, spec = greedy_vanilla_and_tree(lm, VLMSpecVLMTreeDrafter, drafter, rows, torch.rand(2, 3, 32, 32))
    assert torch.equal(spec.tokens, vanilla.tokens) and drafter.last_kept.tolist() == [4, 4]


def test_a_fixed_run_that_is_no_grid_is_refused_in_one_line():
    from mmspec.errors import InputError

    lm = LlavaCachedLM(tiny_llava())
    lm.model.config.image_seq_length = 15
    with pytest.raises(InputError, match="use the eagle, vispec or msd drafter") as err:
        VLMSpecVLMDrafter.for_target(lm)
    assert "\n" not in str(err.value)
