"""MSD (`vlm.msd`): decoupled inputs (raw visual embeddings at image positions), its schedule, and losslessness
through the loop."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import greedy_vanilla_and_tree, prompt, tiny_llava

from mmspec.sampling import SamplingParams
from vlm.msd import MSD_TREE, VLMMSDDrafter, VLMMSDTreeDrafter, msd_visual_probability
from vlm.target import LlavaCachedLM

ROWS = [prompt([7, 8, 20], [9], 16), prompt([12], [13, 30, 31, 32], 16), prompt([], [5], 16)]


def test_image_positions_read_the_raw_visual_embedding():
    drafter = VLMMSDDrafter.for_target(LlavaCachedLM(tiny_llava()))
    e, f = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    image = torch.tensor([[False, True, True, False, False], [True, False, False, False, True]])
    x = drafter.fuse(e, f, image)
    torch.testing.assert_close(x[image], e[image])
    torch.testing.assert_close(x[~image], drafter.fuse(e, f)[~image])


def test_schedule():
    assert [msd_visual_probability(s, 40) for s in (0, 19, 20, 30, 38, 39)] == [0.0, 0.0, 0.0, 0.5, 0.9, 1.0]


def test_official_defaults():
    """MSD's code: layer 0 without an input norm, tree depth 5 in EAGLE's count (6 levels here), top_k 10, 59."""
    lm = LlavaCachedLM(tiny_llava())
    drafter = VLMMSDDrafter.for_target(lm)
    assert not drafter.config.input_norm and isinstance(drafter.layers[0].input_layernorm, torch.nn.Identity)
    tree = VLMMSDTreeDrafter(drafter, lm, SamplingParams(temperature=0.0))
    assert (tree.depth, tree.top_k, tree.total) == MSD_TREE == (6, 10, 59)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_msd_equals_greedy_vanilla(batch_size):
    model = tiny_llava(seed=5)
    rows, pixels = ROWS[:batch_size], torch.rand(batch_size, 3, 32, 32)
    lm = LlavaCachedLM(model)
    torch.manual_seed(0)
    drafter = VLMMSDDrafter.for_target(lm)
    vanilla, spec = greedy_vanilla_and_tree(lm, VLMMSDTreeDrafter, drafter, rows, pixels)
    assert torch.equal(spec.tokens, vanilla.tokens)
    assert spec.stats.num_drafts > 0
