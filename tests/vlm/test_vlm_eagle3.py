"""EAGLE-3 as a VLM drafter kind (`mmspec.eagle3`, `vlm.eagle3`): the target's layer inputs it fuses are
transformers' `hidden_states[i]`; `mmspec train vlm-drafter --kind eagle3` trains it with the training-time test and
a draft vocabulary, and greedy trees and chains stay token-for-token the target's in fewer forwards; the TTT loss's
kept keys and values equal a forward over all steps at once (and a wrong mask does not); the official EAGLE-3 layout
round-trips strictly and its export is what readers written from vLLM's and SGLang's EAGLE-3 loaders take."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from vlm_dummies import save_tiny_world_llava

from mmspec.cli import main
from mmspec.draft_layers import run_llama_layers
from mmspec.eagle3 import draft_vocabulary, shifted, ttt_loss
from mmspec.errors import InputError
from vlm.convert import export_official_eagle3, load_official_drafter
from vlm.eagle3 import VLMEagle3Drafter
from vlm.pipeline import SpeculativeVLM
from vlm.world import world_vqa_examples

OFFICIAL_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
                 "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
                 *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny world LLaVA (6 text layers) with an eagle3 drafter of a 60-token draft vocabulary trained by the CLI."""
    folder = save_tiny_world_llava(tmp_path_factory.mktemp("eagle3"), text_layers=6)
    assert main(["train", "vlm-drafter", "--kind", "eagle3", "--target", str(folder), "--work-dir",
                 str(folder / "work"), "--num-train", "24", "--answer-max-tokens", "10", "--batch-size", "8",
                 "--eval-prompts", "4", "--steps", "120", "--lr", "3e-3", "--ttt-steps", "3", "--draft-vocab", "60",
                 "--quiet"]) == 0
    return folder


def test_the_fused_features_are_the_targets_layer_inputs(trained):
    """aux = [hidden_states[2] ; hidden_states[3] ; hidden_states[3]] of a 6-layer target (the official 2, L // 2,
    L - 3), as transformers' own forward reports them."""
    vlm = SpeculativeVLM.from_pretrained(trained, "eagle3")
    assert tuple(vlm.drafter.config.aux_layer_ids) == (2, 3, 3)
    ex = world_vqa_examples("test", 2, seed=0)
    inputs = vlm.encode([e.image for e in ex], [e.prompt for e in ex])
    from vlm.target import prefill_vlm

    prefill_vlm(vlm.lm, inputs, extra_capacity=1)
    with torch.no_grad():
        out = vlm.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                        pixel_values=inputs.pixel_values, output_hidden_states=True)
    hs = out.hidden_states
    real = inputs.attention_mask.bool()
    expected = torch.cat([hs[2], hs[3], hs[3]], dim=-1)
    assert torch.allclose(vlm.lm.last_aux[real], expected[real], atol=1e-5)


def test_training_and_greedy_trees_stay_exact_in_fewer_forwards(trained):
    info = json.loads((trained / "drafters" / "eagle3" / "training.json").read_text())
    d = info["drafter"]
    assert d["final_top1_agreement"] > d["first_top1_agreement"] + 0.2 and d["final_soft_ce"] < d["first_soft_ce"]
    assert d["draft_vocab_size"] == 60 and d["ttt_steps"] == 3 and info["eval"]["greedy_equal_to_vanilla"] is True
    vlm = SpeculativeVLM.from_pretrained(trained, "eagle3")
    drafter = vlm.drafter
    assert int(drafter.t2d.sum()) == 60 and torch.equal(drafter.draft_to_target, drafter.t2d.nonzero()[:, 0])
    logits = drafter.head(torch.randn(2, drafter.hidden_size))  # [2, V]: -inf outside the draft vocabulary
    assert torch.isinf(logits[:, ~drafter.t2d]).all() and torch.isfinite(logits[:, drafter.t2d]).all()
    ex = world_vqa_examples("test", 5, seed=1, long_fraction=1.0)
    images, prompts = [e.image for e in ex], [e.prompt for e in ex]
    vanilla = vlm.generate(images, prompts, max_new_tokens=12, batch_size=5, use_drafter=False)
    tree = vlm.generate(images, prompts, max_new_tokens=12, batch_size=5, budget="fixed")  # the paper tree
    chain = vlm.generate(images, prompts, max_new_tokens=12, batch_size=5, budget="fixed", tree=(6, 1, 7))
    assert tree.token_ids == chain.token_ids == vanilla.token_ids
    assert tree.stats.num_target_forwards < vanilla.stats.num_target_forwards
    assert tree.stats.mean_acceptance_length > 2 and chain.stats.mean_acceptance_length > 1.1


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert draft_vocabulary(counts, 3).tolist() == [2, 3, 5]  # 9, 9 (lower id first), 7; returned in id order
    with pytest.raises(InputError):
        draft_vocabulary(counts, 7)


def reference_ttt_loss(drafter, embeds, aux, target_logits, mask, steps, valid, sees, positions=None, direct=None,
                       later=None) -> torch.Tensor:
    """The TTT loss from one forward over steps 0..k concatenated (earlier steps recomputed), `sees(j, i, s)` the
    [S, S] mask of query step j over key step i; the scoring as the module docstring states it (a compressed
    layout: positions [R, S], step j's element i at element i + j's, the direct elements of step 0, `later` on the
    outputs a later step reads)."""
    r, s, _ = embeds.shape
    inputs, hidden, total = [], aux, 0.0
    positions = torch.arange(1, s + 1).expand(r, s) if positions is None else positions
    beyond = positions[:, -1:] + torch.arange(1, steps + 1)  # [R, steps] positions past the last element

    def at(j):
        return torch.cat([positions, beyond], dim=1)[:, j: j + s]

    for k in range(steps):
        inputs.append(drafter.fuse(shifted(embeds, k), hidden, direct if k == 0 else None))
        x = torch.cat(inputs, dim=1)
        pos = torch.cat([at(j) for j in range(k + 1)], dim=1)
        full = torch.cat([torch.cat([sees(j, i, s) for i in range(k + 1)], 1) for j in range(k + 1)], 0)
        attention = full.unsqueeze(0) & valid.repeat(1, k + 1).unsqueeze(1)
        hidden = run_llama_layers(drafter.layers, drafter.rotary_emb, x, pos, attention)[:, k * s:]
        target = shifted(target_logits, k).float()
        p = torch.softmax(target[..., drafter.draft_to_target], -1)
        keep = shifted(mask, k, False) & drafter.t2d[target.argmax(-1)]
        logp = torch.log_softmax(drafter.draft_logits(hidden), -1)
        total = total + 0.8 ** k * (-(p * logp).sum(-1) * keep).sum() / keep.sum().clamp_min(1)
        hidden = hidden if later is None else later(hidden)
    return total


def test_ttt_keeps_the_keys_of_earlier_steps_as_one_forward_over_all_steps_would():
    """ttt_loss (each step once, earlier steps' keys and values kept) == the loss of a forward over the steps
    concatenated with EAGLE-3's mask (step j sees step 0 causally and steps 1..j at its own index), value and
    gradient; a forward whose later steps see each other causally gives another loss (the check can fail)."""
    torch.manual_seed(0)
    drafter = VLMEagle3Drafter(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                               vocab_size=48, draft_vocab_size=24, aux_layer_ids=(0, 1, 1))
    drafter.set_draft_vocabulary(torch.arange(0, 48, 2))
    r, s = 2, 9
    embeds, aux = torch.randn(r, s, 16), torch.randn(r, s, 48)
    target_logits = torch.randn(r, s, 48) * 3
    mask = torch.rand(r, s) < 0.8
    valid = torch.ones(r, s, dtype=torch.bool)
    valid[1, 7:] = False

    def eagle3(j, i, n):
        return torch.ones(n, n, dtype=torch.bool).tril() if i == 0 else (
            torch.eye(n, dtype=torch.bool) if i <= j else torch.zeros(n, n, dtype=torch.bool))

    loss = ttt_loss(drafter, embeds, aux, target_logits, mask, steps=4, valid=valid)[0]
    grads = torch.autograd.grad(loss, list(drafter.parameters()))
    reference = reference_ttt_loss(drafter, embeds, aux, target_logits, mask, 4, valid, eagle3)
    expected = torch.autograd.grad(reference, list(drafter.parameters()))
    assert torch.allclose(loss, reference, atol=1e-5)
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected))

    def causal_everywhere(j, i, n):
        return torch.ones(n, n, dtype=torch.bool).tril() if i <= j else torch.zeros(n, n, dtype=torch.bool)

    other = reference_ttt_loss(drafter, embeds, aux, target_logits, mask, 4, valid, causal_everywhere)
    assert not torch.allclose(loss, other, atol=1e-3)


def vllm_reader(folder) -> dict[str, tuple]:
    """The parameters vLLM's `Eagle3LlamaForCausalLM.load_weights` fills from an export, written from its code:
    `t2d` skipped, `d2t` -> draft_id_to_target_id, names outside lm_head prefixed `model.`, `midlayer.` ->
    `layers.0.`, q/k/v and gate/up stacked into qkv_proj / gate_up_proj. Returns {param: shape parts}; every
    weight must land exactly once."""
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] < config["vocab_size"]
    assert config["eagle_config"]["use_aux_hidden_state"] is True and config["tie_word_embeddings"] is False
    params: dict[str, list] = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if "t2d" in name:
            continue
        name = name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else (
            name if "lm_head" in name else "model." + name)
        name = name.replace("midlayer.", "layers.0.")
        for shard in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"):
            if shard in name:
                name = name.replace(shard, ".qkv_proj" if shard in (".q_proj", ".k_proj", ".v_proj")
                                    else ".gate_up_proj")
        params.setdefault(name, []).append(tuple(tensor.shape))
    return {name: sorted(shapes) for name, shapes in params.items()}


def sglang_reader(folder) -> dict[str, list]:
    """The parameters SGLang's `LlamaForCausalLMEagle3.load_weights` fills, written from its code: `d2t` becomes the
    hot token ids, `t2d` skipped, q/k/v and gate/up stacked, `model.` prefixed where the bare name is not a
    parameter (it keeps `midlayer` as its module name)."""
    bare = {"lm_head.weight"}
    params: dict[str, list] = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if "d2t" in name:
            params["hot_token_id"] = [tuple(tensor.shape)]
            continue
        if "t2d" in name:
            continue
        for shard in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"):
            if shard in name:
                name = name.replace(shard, ".qkv_proj" if shard in (".q_proj", ".k_proj", ".v_proj")
                                    else ".gate_up_proj")
        params.setdefault(name if name in bare else f"model.{name}", []).append(tuple(tensor.shape))
    return {name: sorted(shapes) for name, shapes in params.items()}


def test_the_official_layout_round_trips_and_serves(trained, tmp_path):
    vlm = SpeculativeVLM.from_pretrained(trained, "eagle3")
    drafter = vlm.drafter
    out = export_official_eagle3(drafter, tmp_path / "official")
    assert set(load_file(str(out / "model.safetensors"))) == OFFICIAL_KEYS
    h, kv, d = 32, 2 * (32 // 4), 64  # hidden, k/v rows (2 heads x 8), FFN
    expected = {"model.fc.weight": [(h, 3 * h)],
                "model.layers.0.self_attn.qkv_proj.weight": sorted([(h, 2 * h), (kv, 2 * h), (kv, 2 * h)]),
                "model.layers.0.self_attn.o_proj.weight": [(h, h)],
                "model.layers.0.mlp.gate_up_proj.weight": [(d, h), (d, h)],
                "model.layers.0.mlp.down_proj.weight": [(h, d)], "model.norm.weight": [(h,)],
                **{f"model.layers.0.{n}.weight": [(h,)] for n in ("input_layernorm", "hidden_norm",
                                                                   "post_attention_layernorm")},
                "lm_head.weight": [(60, h)], "draft_id_to_target_id": [(60,)]}
    assert vllm_reader(out) == expected
    sglang = {k.replace("layers.0.", "midlayer."): v for k, v in expected.items()}
    sglang["hot_token_id"] = sglang.pop("draft_id_to_target_id")
    assert sglang_reader(out) == sglang
    # the command both ways
    assert main(["convert", "vlm-drafter", "--to-official", "--kind", "eagle3", "--drafter",
                 str(trained / "drafters" / "eagle3"), "--target", str(trained), "--out", str(tmp_path / "cli")]) == 0
    assert main(["convert", "vlm-drafter", "--kind", "eagle3", "--drafter", str(tmp_path / "cli"), "--target",
                 str(trained), "--out", str(tmp_path / "back")]) == 0
    assert SpeculativeVLM.from_pretrained(trained, "eagle3", drafter_path=tmp_path / "back").drafter is not None
    # and back: strict, the same weights and buffers, the same greedy answers
    loaded = load_official_drafter(out, vlm.lm, "eagle3")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    state = load_file(str(out / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items() if k != "t2d"}  # vLLM's spelling
    save_file(renamed, str(out / "model.safetensors"))
    again = load_official_drafter(out, vlm.lm, "eagle3")  # t2d derived from d2t
    assert torch.equal(again.t2d, drafter.t2d)
    save_file({k: v for k, v in renamed.items() if k != "norm.weight"}, str(out / "model.safetensors"))
    with pytest.raises(InputError, match="lacks norm.weight") as err:
        load_official_drafter(out, vlm.lm, "eagle3")
    assert "\n" not in str(err.value)
