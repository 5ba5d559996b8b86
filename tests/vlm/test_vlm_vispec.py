"""ViSpec (`vlm.vispec`): the official adaptor, the short drafter layout (num_q - 1 compressed tokens per image run
entering directly, true positions, img_fc with the global feature after the image and 0 before it), the
anti-shortcut features, its cached path against its training forward, and losslessness through the loop."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import (
    IMAGE_TOKEN,
    assert_root_is_the_layout_forward,
    batch,
    greedy_vanilla_and_tree,
    prompt,
    tiny_llava,
)

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


def test_adaptor_is_the_official_cross_attention():
    """imadpt: queries [num_q, heads, head_dim] used as they are (no query projection), bias-free projections, the
    target's head count; equal to an independent multi-head attention computation."""
    lm = LlavaCachedLM(tiny_llava())
    drafter = VLMViSpecDrafter.for_target(lm, num_queries=3)
    a = drafter.imadpt
    heads, d = 4, 8  # tiny_llava's text model: 4 heads of 8
    assert tuple(a.q.shape) == (3, heads, d) and not hasattr(a, "q_proj")
    assert a.k_proj.bias is None and a.v_proj.bias is None and a.o_proj.bias is None
    image = torch.randn(2, 16, 32)
    k = a.k_proj(image).view(2, 16, heads, d)
    v = a.v_proj(image).view(2, 16, heads, d)
    scores = torch.einsum("qhd,nthd->nhqt", a.q, k) / d ** 0.5
    out = torch.einsum("nhqt,nthd->nqhd", scores.softmax(-1), v).reshape(2, 3, 32)
    torch.testing.assert_close(a(image), a.o_proj(out), atol=1e-5, rtol=1e-5)
    tokens, g = drafter.compress(image)
    assert tokens.shape == (2, 2, 32) and g.shape == (2, 32)  # num_q - 1 compressed tokens, the last is g


@pytest.mark.parametrize("num_queries", [2, 3])
def test_layout(num_queries):
    """Compressed tokens at the run's last num_q - 1 positions, entering directly; img_fc([f ; g]) after the image,
    img_fc([f ; 0]) before it; true positions; a sequence without an image is all text with g = 0."""
    lm = LlavaCachedLM(tiny_llava())
    torch.manual_seed(0)
    drafter = trained_looking(VLMViSpecDrafter.for_target(lm, num_queries=num_queries))
    rows = ROWS[:2]
    inputs = batch(rows, torch.rand(2, 3, 32, 32))
    prefill_vlm(lm, inputs, 1)
    embeds, features = lm.prompt_embeds, lm.last_hidden
    layout = vispec_layout(drafter, inputs.input_ids, embeds, features, IMAGE_TOKEN)
    n_c, length = num_queries - 1, inputs.input_ids.shape[1]
    tokens, g = drafter.compress(embeds[inputs.input_ids == IMAGE_TOKEN].view(2, 16, 32))
    for b, r in enumerate(rows):
        s, e = r.index(IMAGE_TOKEN), r.index(IMAGE_TOKEN) + 15
        expected = [i for i in range(1, length) if i < s or i > e - n_c]
        assert layout["positions"][b].tolist() == expected
        for col, i in enumerate(expected):
            if e - n_c < i <= e:
                assert layout["direct"][b, col]
                torch.testing.assert_close(layout["embeds"][b, col], tokens[b, i - (e - n_c + 1)])
                continue
            assert not layout["direct"][b, col]
            g_i = g[b] if i > e else torch.zeros_like(g[b])
            fused = drafter.img_fc(torch.cat([features[b, i - 1], g_i]))
            torch.testing.assert_close(layout["features"][b, col], fused)
            torch.testing.assert_close(layout["embeds"][b, col], embeds[b, i])
    text = torch.tensor([[1, 7, 8, 9, 10]])
    e_text, f_text = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    plain = vispec_layout(drafter, text, e_text, f_text, IMAGE_TOKEN)
    assert plain["positions"].tolist() == [[1, 2, 3, 4]] and not plain["direct"].any()
    torch.testing.assert_close(plain["features"], drafter.with_global(f_text[:, :-1], torch.zeros(1, 32)))


def test_anti_shortcut_features_replace_every_text_element_but_the_first():
    lm = LlavaCachedLM(tiny_llava())
    drafter = VLMViSpecDrafter.for_target(lm)  # img_fc starts as [I | 0]: features pass through
    text = torch.tensor([[1, 7, 8, 9, 10]])
    e, f, own = torch.randn(1, 5, 32), torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    layout = vispec_layout(drafter, text, e, f, IMAGE_TOKEN, shortcut_features=own)
    torch.testing.assert_close(layout["features"][0, 0], f[0, 0])  # position 1 keeps the target's f_0
    torch.testing.assert_close(layout["features"][0, 1:], own[0, 1:4])  # position i reads own[i - 1]


def test_official_defaults():
    """ViSpec's code: layer 0 without an input norm; tree depth 3 in EAGLE's count (4 levels here), top_k 8, 30."""
    lm = LlavaCachedLM(tiny_llava())
    drafter = VLMViSpecDrafter.for_target(lm)
    assert not drafter.config.input_norm
    tree = VLMViSpecTreeDrafter(drafter, lm, SamplingParams(temperature=0.0))
    assert (tree.depth, tree.top_k, tree.total) == (4, 8, 30)
    assert drafter.image_tokens_attended(576) == 1


@pytest.mark.parametrize("batch_size,num_queries", [(1, 2), (3, 2), (3, 4)])
def test_greedy_vispec_equals_greedy_vanilla(batch_size, num_queries):
    model = tiny_llava(seed=5)
    rows, pixels = ROWS[:batch_size], torch.rand(batch_size, 3, 32, 32)
    lm = LlavaCachedLM(model)
    torch.manual_seed(0)
    drafter = trained_looking(VLMViSpecDrafter.for_target(lm, num_queries=num_queries))
    vanilla, spec = greedy_vanilla_and_tree(lm, VLMViSpecTreeDrafter, drafter, rows, pixels)
    assert torch.equal(spec.tokens, vanilla.tokens)
    assert spec.stats.num_drafts > 0


def test_cached_root_equals_the_layout_forward():
    """After begin, the drafter's output at the root pair equals its training forward over the layout of the prompt
    followed by the first generated token (compressed image, true positions, g on the text after it)."""
    lm = LlavaCachedLM(tiny_llava(seed=2))
    torch.manual_seed(1)
    drafter = trained_looking(VLMViSpecDrafter.for_target(lm))
    assert_root_is_the_layout_forward(lm, drafter, ROWS[:2], torch.rand(2, 3, 32, 32), lambda layout: drafter(
        layout["embeds"], layout["features"], layout["positions"], direct=layout["direct"]))
