"""The VAR transformer: one block against a hand-written reference of the official formulas, teacher forcing ==
scale-by-scale cached inference == a multi-scale cached prefill (CoDe's hand-over), block causality, the official
parameter names, save/load, and clear config errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from image_ar.var import VARTransformer
from mmspec.errors import InputError

PATCH_NUMS = (1, 2, 3)  # L = 14


def tiny(**kwargs) -> VARTransformer:
    torch.manual_seed(0)
    config = dict(vocab_size=32, cvae=4, num_classes=5, depth=2, embed_dim=16, num_heads=2, patch_nums=PATCH_NUMS)
    model = VARTransformer(**{**config, **kwargs}).eval()
    with torch.no_grad():  # non-trivial modulations, biases and head (zero-initialised ones would hide bugs)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def reference_block(block, x, cond, mask):
    """The official AdaLNSelfAttn formulas written out (non-shared AdaLN)."""
    c = x.shape[-1]
    g1, g2, s1, s2, b1, b2 = block.ada_lin(cond).view(-1, 1, 6, c).unbind(2)
    ln = F.layer_norm(x, (c,), eps=block.ln_wo_grad.eps)
    a = block.attn
    h_in = ln * (1 + s1) + b1
    qkv = h_in @ a.mat_qkv.weight.T + torch.cat([a.q_bias, torch.zeros_like(a.q_bias), a.v_bias])
    b, n, _ = x.shape
    q, k, v = qkv.view(b, n, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
    if a.attn_l2_norm:
        q = F.normalize(q, dim=-1) * a.scale_mul_1H11.clamp_max(math.log(100)).exp()
        k = F.normalize(k, dim=-1)
        scale = 1.0
    else:
        scale = 0.25 / math.sqrt(a.head_dim)
    att = (q @ k.transpose(-1, -2)) * scale
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    out = a.proj((att @ v).transpose(1, 2).reshape(b, n, c))
    x = x + out * g1
    ln2 = F.layer_norm(x, (c,), eps=block.ln_wo_grad.eps)
    ffn = block.ffn.fc2(F.gelu(block.ffn.fc1(ln2 * (1 + s2) + b2), approximate="tanh"))
    return x + ffn * g2


@pytest.mark.parametrize("l2", [True, False])
def test_block_matches_the_official_formulas(l2):
    model = tiny(attn_l2_norm=l2)
    block = model.blocks[0]
    x, cond = torch.randn(3, 14, 16), torch.randn(3, 16)
    mask = model.levels.unsqueeze(0) <= model.levels.unsqueeze(1)
    got = block(x, cond, mask.expand(3, -1, -1))
    torch.testing.assert_close(got, reference_block(block, x, cond, mask), rtol=1e-5, atol=1e-5)


def scale_inputs(b: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, 14 - 1, 4, generator=torch.Generator().manual_seed(seed))  # scales 1.. [B, 13, Cvae]


@pytest.mark.parametrize("shared_aln", [False, True])
def test_teacher_forcing_equals_scale_by_scale_and_multi_scale_cached_inference(shared_aln):
    model = tiny(shared_aln=shared_aln)
    labels, feats = torch.tensor([0, 3, 5]), scale_inputs(3)  # 5 = the null class
    with torch.no_grad():
        full = model(labels, feats)  # [3, 14, V]
        cond = model.condition(labels)
        embedded = torch.cat([model.first_token_map(cond), model.embed_inputs(feats, model.first_l)], 1)
        cache = model.new_cache(3)
        steps = [model.forward_cached(embedded[:, b:e], cond, cache, si) for si, (b, e) in enumerate(model.bounds)]
        prefill_cache = model.new_cache(3)
        prefix = model.forward_cached(embedded[:, :5], cond, prefill_cache, 0)  # scales 0 and 1 in one pass
        rest = model.forward_cached(embedded[:, 5:], cond, prefill_cache, 2)
    assert full.shape == (3, 14, 32)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([prefix, rest], 1), full, rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == [14, 14, 14]


def test_attention_is_block_causal_over_scales():
    model = tiny()
    labels, feats = torch.tensor([1, 2]), scale_inputs(2)
    changed = feats.clone()
    changed[:, 4:] += 1.0  # the inputs of scale 2 (positions 5..13)
    with torch.no_grad():
        a, b = model(labels, feats), model(labels, changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])  # scales 0 and 1 do not see scale 2
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_condition_dropout_uses_the_null_class_only_when_asked():
    model = tiny(cond_drop_rate=1.0)
    labels, feats = torch.tensor([0, 1]), scale_inputs(2)
    with torch.no_grad():
        dropped = model(labels, feats, drop_condition=True)
        null = model(torch.tensor([5, 5]), feats)
        kept = model(labels, feats)  # eval mode: no dropout
    torch.testing.assert_close(dropped, null)
    assert not torch.allclose(kept, null)


def test_parameter_names_follow_the_official_state_dict():
    keys = set(tiny().state_dict())
    for key in ("word_embed.weight", "class_emb.weight", "pos_start", "pos_1LC", "lvl_embed.weight",
                "blocks.0.attn.mat_qkv.weight", "blocks.0.attn.q_bias", "blocks.0.attn.v_bias",
                "blocks.0.attn.scale_mul_1H11", "blocks.0.attn.proj.weight", "blocks.0.ffn.fc1.weight",
                "blocks.0.ffn.fc2.bias", "blocks.1.ada_lin.1.weight", "head_nm.ada_lin.1.weight", "head.weight"):
        assert key in keys, key
    assert "shared_ada_lin.1.weight" in tiny(shared_aln=True).state_dict()
    assert tiny(shared_aln=True).blocks[0].ada_gss.shape == (1, 1, 6, 16)


def test_default_width_and_heads_follow_depth():
    model = VARTransformer(vocab_size=8, cvae=2, num_classes=2, depth=2, patch_nums=(1, 2))
    assert model.embed_dim == 128 and model.num_heads == 2 and model.num_tokens == 5


def test_save_and_load_round_trip(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "var")
    loaded = VARTransformer.from_pretrained(tmp_path / "var").eval()
    labels, feats = torch.tensor([2]), scale_inputs(1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(labels, feats), model(labels, feats))


@pytest.mark.parametrize("kwargs, word", [
    ({"embed_dim": 18, "num_heads": 4}, "divisible"),
    ({"patch_nums": (1, 3, 2)}, "increasing"),
    ({"depth": 0}, "depth"),
])
def test_bad_configs_are_clear_errors(kwargs, word):
    with pytest.raises(InputError, match=word):
        VARTransformer(**{"vocab_size": 8, "cvae": 2, "num_classes": 2, "depth": 2, "patch_nums": (1, 2), **kwargs})
