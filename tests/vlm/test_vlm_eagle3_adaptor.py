"""EAGLE-3 with ViSpec's vision adaptor (`vlm.eagle3`, `--vision-adaptor`): the training-time test over ViSpec's
compressed layout equals one forward over its steps concatenated, the loop's cached root equals the layout forward
of the prompt and the first token, greedy trees stay the target's, and the trainer makes, evaluates and refuses to
export such a drafter."""

from __future__ import annotations

import json

import pytest
import torch
from test_vlm_eagle3 import reference_ttt_loss
from vlm_dummies import (
    assert_root_is_the_layout_forward,
    greedy_vanilla_and_tree,
    prompt,
    save_tiny_world_llava,
    tiny_llava,
)

from mmspec.cli import main
from mmspec.draft_layers import run_llama_layers
from mmspec.eagle3 import ttt_loss
from mmspec.errors import InputError
from vlm.convert import export_official_eagle3
from vlm.eagle3 import VLMEagle3Drafter, VLMViSpec3TreeDrafter
from vlm.pipeline import SpeculativeVLM
from vlm.target import LlavaCachedLM

ROWS = [prompt([7, 8, 20], [9], 16), prompt([12], [13, 30, 31, 32], 16), prompt([], [5], 16)]


def adaptor_drafter(lm, seed: int = 0) -> VLMEagle3Drafter:
    """An EAGLE-3 drafter with the adaptor, img_fc moved off its [I | 0] start so the global feature matters."""
    torch.manual_seed(seed)
    drafter = VLMEagle3Drafter.for_target(lm, num_queries=2).eval()
    with torch.no_grad():
        drafter.img_fc.weight.add_(0.1 * torch.randn_like(drafter.img_fc.weight))
    return drafter


def test_ttt_over_the_compressed_layout_is_one_forward_over_its_steps():
    """Non-contiguous positions (a compressed image run), a direct element at step 0 and the global feature fused
    into every later step's input: ttt_loss == the concatenated forward, value and gradient; without `later` the
    loss differs (the check can fail)."""
    torch.manual_seed(0)
    drafter = VLMEagle3Drafter(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                               vocab_size=48, aux_layer_ids=(0, 1, 1), num_queries=2)
    with torch.no_grad():  # off its [I | 0] start: the global feature matters
        drafter.img_fc.weight.add_(0.3 * torch.randn_like(drafter.img_fc.weight))
    r, s = 2, 8
    embeds, aux = torch.randn(r, s, 16), torch.randn(r, s, 48)
    target_logits, mask = torch.randn(r, s, 48) * 3, torch.rand(r, s) < 0.8
    valid = torch.ones(r, s, dtype=torch.bool)
    valid[1, 6:] = False
    positions = torch.tensor([[1, 2, 9, 10, 11, 12, 13, 14], [1, 5, 6, 7, 8, 9, 10, 11]])  # [R, S]
    direct = torch.zeros(r, s, dtype=torch.bool)
    direct[0, 1] = direct[1, 0] = True
    g = torch.randn(r, 16)

    def later(o):
        return drafter.with_global(o, g)

    def eagle3(j, i, n):
        return torch.ones(n, n, dtype=torch.bool).tril() if i == 0 else (
            torch.eye(n, dtype=torch.bool) if i <= j else torch.zeros(n, n, dtype=torch.bool))

    loss = ttt_loss(drafter, embeds, aux, target_logits, mask, steps=3, valid=valid, positions=positions,
                    direct=direct, later_features=later)[0]
    reference = reference_ttt_loss(drafter, embeds, aux, target_logits, mask, 3, valid, eagle3, positions, direct,
                                   later)
    grads = torch.autograd.grad(loss, list(drafter.parameters()), allow_unused=True)
    expected = torch.autograd.grad(reference, list(drafter.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    plain = reference_ttt_loss(drafter, embeds, aux, target_logits, mask, 3, valid, eagle3, positions, direct)
    assert not torch.allclose(loss, plain, atol=1e-4)


def test_cached_root_equals_the_layout_forward():
    """After begin, the root's output is the drafter's forward over ViSpec's layout of the prompt and the first
    token: compressed image, true positions, img_fc([fc(a) ; g]) on the text after the image."""
    lm = LlavaCachedLM(tiny_llava(seed=2))
    drafter = adaptor_drafter(lm, seed=1)
    assert drafter.image_tokens_attended(576) == 1 and drafter.loop_drafter is VLMViSpec3TreeDrafter

    def layout_forward(layout):
        x = drafter.fuse(layout["embeds"], layout["features"], layout["direct"])
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril().unsqueeze(0)
        return run_llama_layers(drafter.layers, drafter.rotary_emb, x, layout["positions"], causal)

    assert_root_is_the_layout_forward(lm, drafter, ROWS[:2], torch.rand(2, 3, 32, 32), layout_forward,
                                      features_of=lambda lm: lm.last_aux)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_trees_with_the_adaptor_are_the_targets(batch_size):
    lm = LlavaCachedLM(tiny_llava(seed=5))
    drafter = adaptor_drafter(lm)
    vanilla, spec = greedy_vanilla_and_tree(lm, drafter.loop_drafter, drafter, ROWS[:batch_size],
                                            torch.rand(batch_size, 3, 32, 32))
    assert torch.equal(spec.tokens, vanilla.tokens) and spec.stats.num_drafts > 0


def test_the_trainer_makes_and_refuses_to_export_an_adaptor_drafter(tmp_path, capsys):
    folder = save_tiny_world_llava(tmp_path, text_layers=6)
    common = ["train", "vlm-drafter", "--target", str(folder), "--work-dir", str(tmp_path / "work"), "--num-train",
              "12", "--answer-max-tokens", "8", "--batch-size", "6", "--eval-prompts", "2", "--steps", "6",
              "--quiet"]
    assert main([*common, "--kind", "eagle", "--vision-adaptor"]) == 2
    assert "--vision-adaptor does not apply to the eagle drafter" in capsys.readouterr().err
    assert main([*common, "--kind", "eagle3", "--vision-adaptor", "--ttt-steps", "2"]) == 0
    out = folder / "drafters" / "eagle3"
    info = json.loads((out / "training.json").read_text())
    assert info["drafter"]["vision_adaptor"] is True and info["eval"]["greedy_equal_to_vanilla"] is True
    assert info["eval"]["drafter_image_tokens_attended"] == 1
    card = (out / "README.md").read_text()
    assert "--vision-adaptor" in card and "ViSpec's vision adaptor" in card
    vlm = SpeculativeVLM.from_pretrained(folder, "eagle3")
    assert vlm.drafter.vision_adaptor and vlm.drafter.config.num_queries == 2
    with pytest.raises(InputError, match="vision adaptor"):
        export_official_eagle3(vlm.drafter, tmp_path / "official")
