"""Official EAGLE-format drafters (`vlm.convert`): synthetic checkpoints with the official key layout and shapes
load strictly and compute what the official code computes (an independent transcription of EAGLE's layer 0:
fc, no input norm, Llama attention with RoPE at the official positions, the MLP after post_attention_layernorm;
ViSpec's adaptor), through `mmspec convert vlm-drafter` too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from vlm_dummies import tiny_llava

from mmspec.errors import InputError
from vlm.convert import load_official_drafter
from vlm.target import LlavaCachedLM

H, HEADS, KV, D, FFN = 32, 4, 2, 8, 64  # tiny_llava's text model


def official_state(lm: LlavaCachedLM, vispec: bool = False, num_q: int = 2) -> dict[str, torch.Tensor]:
    """Random weights in the official layout (norm weights not ones, so a missed norm shows)."""
    g = torch.Generator().manual_seed(3)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    state = {"fc.weight": r(H, 2 * H), "fc.bias": r(H),
             "layers.0.self_attn.q_proj.weight": r(HEADS * D, H), "layers.0.self_attn.k_proj.weight": r(KV * D, H),
             "layers.0.self_attn.v_proj.weight": r(KV * D, H), "layers.0.self_attn.o_proj.weight": r(H, HEADS * D),
             "layers.0.mlp.gate_proj.weight": r(FFN, H), "layers.0.mlp.up_proj.weight": r(FFN, H),
             "layers.0.mlp.down_proj.weight": r(H, FFN),
             "layers.0.post_attention_layernorm.weight": 1 + r(H),
             "embed_tokens.weight": lm.text.embed_tokens.weight.detach().clone()}
    if vispec:
        state.update({"imadpt.q": r(num_q, HEADS, D, scale=D ** -0.5), "imadpt.k_proj.weight": r(H, H),
                      "imadpt.v_proj.weight": r(H, H), "imadpt.o_proj.weight": r(H, H),
                      "img_fc.weight": r(H, 2 * H), "img_fc.bias": r(H)})
    return state


def write_official(folder: Path, state: dict, fmt: str = "safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "intermediate_size": FFN, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 128, "vocab_size": 99, "num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


# ------------------------------------------------------------------ independent transcription of the official code
def rms_norm(x, w, eps=1e-6):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, positions, theta=10000.0):  # x [S, heads, D]
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    angles = positions.float()[:, None] * inv[None]  # [S, D/2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + half * sin


def official_layer0(state, x):
    """EAGLE's decoder layer 0 on one sequence x [S, H] at the official positions 0..S-1 (causal)."""
    s = x.shape[0]
    pos = torch.arange(s)
    q = rotate((x @ state["layers.0.self_attn.q_proj.weight"].T).view(s, HEADS, D), pos)
    k = rotate((x @ state["layers.0.self_attn.k_proj.weight"].T).view(s, KV, D), pos)
    v = (x @ state["layers.0.self_attn.v_proj.weight"].T).view(s, KV, D)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, HEADS * D)
    x = x + attn @ state["layers.0.self_attn.o_proj.weight"].T
    n = rms_norm(x, state["layers.0.post_attention_layernorm.weight"])
    gate = torch.nn.functional.silu(n @ state["layers.0.mlp.gate_proj.weight"].T)
    mlp = gate * (n @ state["layers.0.mlp.up_proj.weight"].T)
    return x + mlp @ state["layers.0.mlp.down_proj.weight"].T


def official_fc(state, e, f):
    return torch.cat([e, f], -1) @ state["fc.weight"].T + state["fc.bias"]


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle_checkpoint_computes_the_official_forward(tmp_path, fmt):
    lm = LlavaCachedLM(tiny_llava())
    state = official_state(lm)
    drafter = load_official_drafter(write_official(tmp_path / "eagle", state, fmt), lm, "eagle")
    assert not drafter.config.input_norm
    e, f = torch.randn(1, 7, H), torch.randn(1, 7, H)
    with torch.no_grad():
        ours = drafter(e, f)[0]  # mmspec positions 1..7
    torch.testing.assert_close(ours, official_layer0(state, official_fc(state, e[0], f[0])), atol=1e-5, rtol=1e-4)


def test_msd_checkpoint_reads_raw_visual_embeddings(tmp_path):
    lm = LlavaCachedLM(tiny_llava())
    state = official_state(lm)
    drafter = load_official_drafter(write_official(tmp_path / "msd", state), lm, "msd")
    e, f = torch.randn(1, 6, H), torch.randn(1, 6, H)
    image = torch.tensor([[False, True, True, True, False, False]])
    x = torch.where(image[0, :, None], e[0], official_fc(state, e[0], f[0]))
    with torch.no_grad():
        ours = drafter(e, f, direct=image)[0]
    torch.testing.assert_close(ours, official_layer0(state, x), atol=1e-5, rtol=1e-4)


def test_vispec_checkpoint_adaptor_and_img_fc(tmp_path):
    lm = LlavaCachedLM(tiny_llava())
    state = official_state(lm, vispec=True, num_q=3)
    drafter = load_official_drafter(write_official(tmp_path / "vispec", state), lm, "vispec")
    assert drafter.config.num_queries == 3
    image = torch.randn(2, 16, H)
    k = (image @ state["imadpt.k_proj.weight"].T).view(2, 16, HEADS, D)
    v = (image @ state["imadpt.v_proj.weight"].T).view(2, 16, HEADS, D)
    scores = torch.einsum("qhd,nthd->nhqt", state["imadpt.q"], k) / D ** 0.5
    out = torch.einsum("nhqt,nthd->nqhd", scores.softmax(-1), v).reshape(2, 3, H) @ state["imadpt.o_proj.weight"].T
    with torch.no_grad():
        tokens, g = drafter.compress(image)
        fused = drafter.with_global(torch.randn(2, 4, H).mul(0).add(1), g)
    torch.testing.assert_close(torch.cat([tokens, g[:, None]], 1), out, atol=1e-5, rtol=1e-4)
    expected = torch.cat([torch.ones(2, 4, H), g[:, None].expand(-1, 4, -1)], -1) @ state["img_fc.weight"].T
    torch.testing.assert_close(fused, expected + state["img_fc.bias"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("broken,message", [
    ("missing_norm", "layers.0.post_attention_layernorm.weight"),
    ("extra_key", "layers.0.self_attn.q_proj.bias"),
    ("other_embeddings", "embed_tokens differ"),
    ("vispec_as_eagle", "load it with kind vispec"),
])
def test_bad_checkpoints_are_refused_in_one_line(tmp_path, broken, message):
    lm = LlavaCachedLM(tiny_llava())
    state = official_state(lm, vispec=broken == "vispec_as_eagle")
    if broken == "missing_norm":
        del state["layers.0.post_attention_layernorm.weight"]
    elif broken == "extra_key":
        state["layers.0.self_attn.q_proj.bias"] = torch.zeros(HEADS * D)
    elif broken == "other_embeddings":
        state["embed_tokens.weight"] = state["embed_tokens.weight"] + 1
    with pytest.raises(InputError, match=message):
        load_official_drafter(write_official(tmp_path / broken, state), lm, "eagle")


def test_convert_command_on_the_embedded_target(tmp_path):
    """`mmspec convert vlm-drafter` on an official-layout EAGLE drafter for the shipped world LLaVA: the written
    folder loads as the pipeline's drafter and greedy decoding with it equals the target alone."""
    from safetensors.torch import load_file

    from mmspec.cli import main
    from mmspec.data.artifacts import ASSETS_DIR
    from vlm.pipeline import SpeculativeVLM
    from vlm.world import world_vqa_examples

    target = ASSETS_DIR / "vlm"
    config = json.loads((target / "config.json").read_text())["text_config"]
    weights = load_file(str(target / "model.safetensors"))
    embed = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    h, heads, ffn = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    kv = config.get("num_key_value_heads") or heads
    d = h // heads
    g = torch.Generator().manual_seed(0)
    state = {"fc.weight": torch.randn(h, 2 * h, generator=g) * 0.05, "fc.bias": torch.zeros(h),
             "layers.0.self_attn.q_proj.weight": torch.randn(heads * d, h, generator=g) * 0.05,
             "layers.0.self_attn.k_proj.weight": torch.randn(kv * d, h, generator=g) * 0.05,
             "layers.0.self_attn.v_proj.weight": torch.randn(kv * d, h, generator=g) * 0.05,
             "layers.0.self_attn.o_proj.weight": torch.randn(h, heads * d, generator=g) * 0.05,
             "layers.0.mlp.gate_proj.weight": torch.randn(ffn, h, generator=g) * 0.05,
             "layers.0.mlp.up_proj.weight": torch.randn(ffn, h, generator=g) * 0.05,
             "layers.0.mlp.down_proj.weight": torch.randn(h, ffn, generator=g) * 0.05,
             "layers.0.post_attention_layernorm.weight": torch.ones(h), "embed_tokens.weight": embed.float()}
    official = tmp_path / "official"
    official.mkdir()
    (official / "config.json").write_text(json.dumps({
        "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": ffn,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6), "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"], "num_hidden_layers": 1}))
    save_file({k: v.contiguous().to(embed.dtype) for k, v in state.items()}, str(official / "model.safetensors"))
    out = tmp_path / "drafter"
    assert main(["convert", "vlm-drafter", "--drafter", str(official), "--kind", "eagle", "--target", str(target),
                 "--out", str(out)]) == 0
    vlm = SpeculativeVLM.from_pretrained(target, "eagle", drafter_path=out)
    examples = world_vqa_examples("test", 2, seed=0, long_fraction=1.0)
    images, prompts = [ex.image for ex in examples], [ex.prompt for ex in examples]
    spec = vlm.generate(images, prompts, max_new_tokens=12, tree=(3, 4, 10))
    vanilla = vlm.generate(images, prompts, max_new_tokens=12, use_drafter=False)
    assert spec.token_ids == vanilla.token_ids and spec.stats.num_drafts > 0
