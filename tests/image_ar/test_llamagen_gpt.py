"""LlamaGenGPT: cached decoding (chunks, ragged rows, trees) equals the full forward, 2D RoPE, CFG conditions,
label dropout, presets, errors, diffusers save/load. The match with an independent re-implementation of the
official forward is in test_llamagen_convert.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from image_ar.llamagen import LlamaGenGPT, ffn_hidden_dim, rope_table_2d
from image_ar.llamagen.rope import apply_rope
from mmspec.errors import InputError

ATOL = 1e-5


def tiny(seed: int = 0, **overrides) -> LlamaGenGPT:
    """A tiny model with random (not zero-initialised) weights so that logits differ between positions."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, dim=32, n_layer=2, n_head=4, block_size=16, num_classes=10, multiple_of=32,
               caption_dim=8)
    cfg.update(overrides)
    model = LlamaGenGPT(**cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2 and "embedding" not in name and "tok_embeddings" not in name:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
            else:
                p.normal_()
    return model


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def _setup(model, batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, model.vocab_size, (batch, model.block_size), generator=g)
    if model.model_type == "c2i":
        cond = torch.randint(0, model.num_classes, (batch,), generator=g)
    else:
        cond = torch.randn(batch, model.cls_token_num, model.config.caption_dim, generator=g)
    with torch.no_grad():
        full = model(seq, cond).logits  # [B, T, V]: full[:, t] predicts seq[:, t]
    return seq, cond, full


# ------------------------------------------------------------------------------------------- cached decoding
@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 2}, {"n_kv_head": 1}, {"model_type": "t2i", "cls_token_num": 3}])
def test_token_by_token_and_chunks_match_full_forward(kw):
    model = tiny(**kw)
    seq, cond, full = _setup(model)
    c, b = model.cls_token_num, seq.shape[0]
    for chunk in (1, 3):
        cache = model.new_cache(b, c + 16)
        got = [model.prefill_condition(model.embed_condition(cond), cache)]
        assert cache.lengths.tolist() == [c] * b
        t = 0
        while t < 15:
            s = min(chunk, 15 - t)
            slots = cache.slots(s)
            got += list(model.forward_cached(seq[:, t : t + s], slots, cache, slots, cache.attention_mask(slots))
                        .unbind(1))
            cache.commit_chain(torch.full((b,), s))
            t += s
        close(torch.stack(got, 1), full)


def test_ragged_rows_match_full_forward():
    model = tiny(n_kv_head=2)
    seq, cond, full = _setup(model, batch=4)
    c, b, width = model.cls_token_num, 4, 4
    cache = model.new_cache(b, c + 16 + width)
    close(model.prefill_condition(model.embed_condition(cond), cache), full[:, 0])
    g = torch.Generator().manual_seed(3)
    steps = 0
    while bool((cache.lengths - c < 15).any()):
        done = cache.lengths - c  # [B] image tokens committed per row
        n = torch.minimum(torch.randint(1, width + 1, (b,), generator=g), 15 - done)  # [B], 0 for finished rows
        slots = cache.slots(width)  # [B, W]; entries past a row's n are scratch
        tokens = seq.gather(1, (done[:, None] + torch.arange(width)).clamp_max(15))
        positions = slots.clamp_max(model.max_seq_len - 1)
        logits = model.forward_cached(tokens, positions, cache, slots, cache.attention_mask(slots))
        for row in range(b):
            k, d = int(n[row]), int(done[row])
            close(logits[row, :k], full[row, d + 1 : d + 1 + k])
        cache.commit_chain(n)
        steps += 1
    assert steps > 4


def test_tree_positions_match_full_forward_along_each_path():
    model = tiny(n_kv_head=2)
    seq1, cond, full1 = _setup(model, batch=2)
    seq2 = seq1.clone()
    seq2[:, 6:] = (seq1[:, 6:] + 1 + torch.arange(10)) % model.vocab_size  # diverges from token 6 on
    with torch.no_grad():
        full2 = model(seq2, cond).logits
    c = model.cls_token_num
    cache = model.new_cache(2, c + 16 + 8)
    model.prefill_condition(model.embed_condition(cond), cache)
    slots = cache.slots(5)
    model.forward_cached(seq1[:, :5], slots, cache, slots, cache.attention_mask(slots))
    cache.commit_chain(torch.full((2,), 5))
    # node: 0 root = token 5, 1 = seq1[6], 2 = seq2[6], 3 = seq1[7], 4 = seq2[7], 5 = seq1[8]
    parents = [-1, 0, 0, 1, 2, 3]
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    tree = torch.eye(6, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            tree[i] |= tree[p]
    tokens = torch.stack([seq1[:, 5], seq1[:, 6], seq2[:, 6], seq1[:, 7], seq2[:, 7], seq1[:, 8]], 1)  # [B, N]
    slots = cache.slots(6)
    positions = cache.lengths[:, None] + depth  # non-contiguous: siblings share a position
    mask = cache.attention_mask(slots, tree.expand(2, 6, 6))
    logits = model.forward_cached(tokens, positions, cache, slots, mask)  # [B, N, V]
    for node, (full, t) in enumerate([(full1, 6), (full1, 7), (full2, 7), (full1, 8), (full2, 8), (full1, 9)]):
        close(logits[:, node], full[:, t])
    assert model.last_hidden.shape == (2, 6, 32)
    # row 0 keeps path A (nodes 0, 1, 3, 5), row 1 path B (nodes 0, 2, 4); decoding goes on from there
    cache.commit_path(torch.tensor([[0, 1, 3, 5], [0, 2, 4, -1]]), torch.tensor([4, 3]))
    nxt = torch.stack([seq1[0, 9], seq2[1, 8]])[:, None]
    slots = cache.slots(1)
    logits = model.forward_cached(nxt, slots, cache, slots, cache.attention_mask(slots))
    close(logits[0, 0], full1[0, 10])
    close(logits[1, 0], full2[1, 9])


def test_t2i_padding_mask_survives_row_selection():
    model = tiny(model_type="t2i", cls_token_num=4)
    seq, cond, _ = _setup(model, batch=2)
    cond_mask = torch.tensor([[False, True, True, True], [False, False, True, True]])
    with torch.no_grad():
        full = model(seq, cond, cond_mask=cond_mask).logits
        unmasked = model(seq, cond).logits
    assert not torch.allclose(full, unmasked, atol=1e-3)  # the mask matters
    cache = model.new_cache(2, 20)
    close(model.prefill_condition(model.embed_condition(cond), cache, cond_mask=cond_mask), full[:, 0])
    cache.select_rows(torch.tensor([1]))
    for t in range(3):
        slots = cache.slots(1)
        logits = model.forward_cached(seq[1:, t : t + 1], slots, cache, slots, cache.attention_mask(slots))
        close(logits[0, 0], full[1, t + 1])
        cache.commit_chain(torch.ones(1, dtype=torch.long))
    cache.reset()
    assert cache.cond_key_mask is None


@pytest.mark.parametrize("kw", [{}, {"model_type": "t2i", "cls_token_num": 3}])
def test_one_token_steps_without_a_mask_give_the_masked_logits(kw):
    """`GuidedRunner.forward` passes mask None for one query per row when every row sits at the same slot: the
    logits are the masked step's, bit for bit (t2i caption padding is still masked: the model builds that mask);
    rows at different slots still get the mask."""
    from mmspec.lm import GuidedRunner

    model = tiny(**kw)
    seq, cond, _ = _setup(model, batch=2)
    cache = model.new_cache(2, model.cls_token_num + 8)
    cond_mask = torch.tensor([[False, True, True], [True, True, True]]) if kw else None
    model.prefill_condition(model.embed_condition(cond), cache, **({"cond_mask": cond_mask} if kw else {}))
    runner = GuidedRunner(model)
    runner.cache = cache
    seen = []
    forward = model.forward_cached
    model.forward_cached = lambda *args: seen.append(args[4]) or forward(*args)
    c = model.cls_token_num
    for lengths, unmasked in (([c, c], True), ([c + 1, c + 1], True), ([c + 2, c + 1], False)):
        cache.lengths = torch.tensor(lengths)
        slots = runner.slots(1)  # [B, 1]
        got = runner.forward(seq[:, :1], slots, slots)
        assert (seen[-1] is None) == unmasked
        with cache.keys_up_to(max(lengths) + 1):
            want = forward(seq[:, :1], slots, cache, slots, cache.attention_mask(slots))
        assert torch.equal(got, want)


def test_window_steps_with_shared_slots_give_the_scattered_logits():
    """`GuidedRunner.forward` reads a window's slots once; when every row writes the same slots (batch 1 with CFG)
    it hands the model one row expanded, which the cache writes with `index_copy_`: logits and cache entries are
    the per-row scatter's, bit for bit; rows at different slots keep their own."""
    from mmspec.lm import GuidedRunner

    model = tiny()
    seq, cond, _ = _setup(model, batch=2)
    c = model.cls_token_num
    seen, forward = [], model.forward_cached

    def recording(*args):
        seen.append(args[3])  # the slots the model gets
        return forward(*args)

    for lengths in ([c, c], [c + 1, c]):
        caches = []
        for _ in range(2):
            cache = model.new_cache(2, c + 8)
            model.prefill_condition(model.embed_condition(cond), cache)
            cache.commit_chain(torch.tensor(lengths) - c)  # rows at `lengths` (the entries past c: stale zeros)
            caches.append(cache)
        runner = GuidedRunner(model)
        runner.cache = caches[0]
        model.forward_cached = recording
        slots = runner.slots(4)  # [B, 4]
        got = runner.forward(seq[:, :4], slots, slots)
        model.forward_cached = forward
        assert (seen[-1].stride(0) == 0) == (lengths[0] == lengths[1])
        with caches[1].keys_up_to(max(lengths) + 4):
            want = forward(seq[:, :4], slots, caches[1], slots.clone(), caches[1].attention_mask(slots))
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))


def test_last_hidden_feeds_the_head_and_backends_agree():
    model = tiny()
    seq, cond, full = _setup(model)
    cache = model.new_cache(3, 20)
    model.prefill_condition(model.embed_condition(cond), cache)
    slots = cache.slots(4)
    logits = model.forward_cached(seq[:, :4], slots, cache, slots, cache.attention_mask(slots))
    assert model.last_hidden.shape == (3, 4, 32) and not model.last_hidden.requires_grad
    close(model.output(model.last_hidden).float(), logits)
    eager = tiny(attention_backend="eager")
    cache = eager.new_cache(3, 20)
    eager.prefill_condition(eager.embed_condition(cond), cache)
    close(eager.forward_cached(seq[:, :4], slots, cache, slots, cache.attention_mask(slots)), logits)


def test_inference_api_ignores_train_mode_dropout():
    model = tiny(token_dropout_p=0.5, resid_dropout_p=0.5, ffn_dropout_p=0.5, drop_path_rate=0.5)
    seq, cond, full = _setup(model)
    model.train()
    cache = model.new_cache(3, 20)
    close(model.prefill_condition(model.embed_condition(cond), cache), full[:, 0])
    with torch.no_grad():
        assert not torch.allclose(model(seq, cond, drop_mask=torch.zeros(3, dtype=torch.bool)).logits, full)


def test_bf16_module():
    model = tiny().to(torch.bfloat16)
    _, cond, _ = _setup(tiny())
    cache = model.new_cache(3, 20)
    assert cache.k[0].dtype == torch.bfloat16
    logits = model.prefill_condition(model.embed_condition(cond), cache)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# -------------------------------------------------------------------------------------------------- 2D RoPE
def test_rope_table_layout_and_condition_zeros():
    grid, hd, c = 4, 8, 3
    table = rope_table_2d(grid, hd, 10000.0, c)  # [C + 16, 4, 2]
    assert table.shape == (c + 16, hd // 2, 2) and table.dtype == torch.float32
    assert not table[:c].any()
    for i in range(grid * grid):
        r, col = divmod(i, grid)
        for j in range(hd // 4):
            freq = 10000.0 ** (-(2 * j) / (hd // 2))
            for pair, step in ((j, r), (hd // 4 + j, col)):
                torch.testing.assert_close(table[c + i, pair], torch.tensor([math.cos(step * freq),
                                                                             math.sin(step * freq)]))
    x = torch.randn(2, c + 16, 3, hd)
    out = apply_rope(x, table)
    assert not out[:, :c].any()  # q and k vanish at the condition positions (official quirk)
    torch.testing.assert_close(out[:, c], x[:, c])  # image token 0: row 0, column 0 -> no rotation
    torch.testing.assert_close(out.norm(dim=-1)[:, c:], x.norm(dim=-1)[:, c:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_rows_give_the_official_formula_bit_for_bit(dtype):
    """The models rotate q and k through `rotate` with `rotation_table` rows: exactly the official complex-pair
    formula (x_even cos - x_odd sin, x_odd cos + x_even sin), condition zeros included."""
    from image_ar.llamagen.rope import rotate, rotation_table

    table = rope_table_2d(4, 8, 10000.0, 2)  # [18, 4, 2]
    x = (torch.randn(2, 18, 3, 8, generator=torch.Generator().manual_seed(0)) * 10).to(dtype)  # [B, S, H, D]
    positions = torch.tensor([list(range(18)), list(range(17, -1, -1))])  # [B, S]
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, S, H, D/2, 2]
    cos, sin = table[positions][..., 0].unsqueeze(2), table[positions][..., 1].unsqueeze(2)  # [B, S, 1, D/2]
    even, odd = pairs[..., 0], pairs[..., 1]
    official = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2).to(dtype)
    assert torch.equal(rotate(x, rotation_table(table)[positions]), official)
    assert torch.equal(apply_rope(x, table[positions]), official)


# ---------------------------------------------------------------------------------------------- conditions
def test_cfg_null_class_and_uncond_caption():
    model = tiny()
    labels = torch.tensor([3, 7, 1])
    drop = torch.tensor([False, True, True])
    emb = model.embed_condition(labels, drop)
    assert emb.shape == (3, 1, 32)
    torch.testing.assert_close(emb[1:, 0], model.cls_embedding.embedding_table.weight[10].expand(2, -1))
    torch.testing.assert_close(emb[0, 0], model.cls_embedding.embedding_table.weight[3])
    torch.testing.assert_close(model.embed_condition(torch.tensor([10]))[0], emb[1])  # label num_classes = null
    # CFG batch [cond; uncond] through the cache equals the two full forwards
    seq, _, full = _setup(model, batch=3)
    labels = _setup(model, batch=3)[1]
    with torch.no_grad():
        null_full = model(seq, labels, drop_mask=torch.ones(3, dtype=torch.bool)).logits
    both = torch.cat([model.embed_condition(labels), model.embed_condition(labels, torch.ones(3, dtype=torch.bool))])
    cache = model.new_cache(6, 20)
    logits = model.prefill_condition(both, cache)
    close(logits, torch.cat([full[:, 0], null_full[:, 0]]))

    t2i = tiny(model_type="t2i", cls_token_num=3)
    caption = torch.randn(2, 3, 8)
    emb = t2i.embed_condition(caption, torch.tensor([True, False]))
    proj = t2i.cls_embedding.cap_proj
    mlp = lambda x: proj.fc2(F.gelu(proj.fc1(x), approximate="tanh"))
    torch.testing.assert_close(emb[0], mlp(t2i.cls_embedding.uncond_embedding))
    torch.testing.assert_close(emb[1], mlp(caption[1]))
    assert "cls_embedding.uncond_embedding" in t2i.state_dict()
    assert "cls_embedding.uncond_embedding" not in dict(t2i.named_parameters())  # official: a buffer


def test_label_dropout_in_training():
    model = tiny(class_dropout_prob=1.0, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)
    seq, labels, _ = _setup(model)
    with torch.no_grad():
        null = model(seq, labels, drop_mask=torch.ones(3, dtype=torch.bool)).logits
        model.train()
        close(model(seq, labels).logits, null)

    model = tiny(class_dropout_prob=0.5, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)
    seq, labels, cond_full = _setup(model, batch=64)
    with torch.no_grad():
        null = model(seq, labels, drop_mask=torch.ones(64, dtype=torch.bool)).logits
        model.train()
        torch.manual_seed(5)
        out = model(seq, labels).logits
    is_cond = (out - cond_full).abs().amax((1, 2)) < ATOL
    is_null = (out - null).abs().amax((1, 2)) < ATOL
    assert bool((is_cond ^ is_null).all())
    assert 16 < int(is_null.sum()) < 48

    no_null = tiny(class_dropout_prob=0.0)
    assert no_null.cls_embedding.embedding_table.weight.shape[0] == 10
    with pytest.raises(InputError, match="null class"):
        no_null.embed_condition(torch.tensor([1]), torch.tensor([True]))


def test_training_loss_and_gradients():
    model = tiny()
    seq, labels, _ = _setup(model)
    out = model(seq, labels, seq)
    assert out.logits.shape == (3, 16, 40)
    close(out.loss, F.cross_entropy(out.logits.reshape(-1, 40), seq.reshape(-1)))
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(seq[:, :1], labels).logits.shape == (3, 1, 40)  # T = 1: the condition alone


# -------------------------------------------------------------------------------------- presets, save/load
def _official_params(n_layer, n_head, dim, vocab=16384, classes=1000):
    hidden = ffn_hidden_dim(dim)
    per_layer = dim * 3 * dim + dim * dim + 3 * dim * hidden + 2 * dim
    return n_layer * per_layer + 2 * vocab * dim + (classes + 1) * dim + dim


@pytest.mark.parametrize("name, millions", [("B", 111), ("L", 343), ("XL", 775), ("XXL", 1411), ("3B", 3097)])
def test_preset_parameter_counts(name, millions):
    with torch.device("meta"):  # nothing allocated
        model = LlamaGenGPT.from_preset(name)
    count = sum(p.numel() for p in model.parameters())
    cfg = model.config
    assert count == _official_params(cfg.n_layer, cfg.n_head, cfg.dim)
    assert round(count / 1e6) == millions
    assert ffn_hidden_dim(768) == 2048 and ffn_hidden_dim(1024) == 2816


@pytest.mark.parametrize("kw", [{}, {"model_type": "t2i", "cls_token_num": 3, "n_kv_head": 2}])
def test_save_pretrained_round_trip(tmp_path, kw):
    model = tiny(**kw)
    seq, cond, full = _setup(model)
    model.save_pretrained(tmp_path)
    loaded = LlamaGenGPT.from_pretrained(tmp_path)
    assert not loaded.training
    public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}
    assert public(loaded.config) == public(model.config)
    with torch.no_grad():
        close(loaded(seq, cond).logits, full)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


# ------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kw, match",
    [({"block_size": 15}, "perfect square"), ({"dim": 24}, "divisible by 4"), ({"cls_token_num": 2}, "c2i"),
     ({"model_type": "i2i"}, "model_type"), ({"n_kv_head": 3}, "n_kv_head"), ({"dim": 30}, "divisible"),
     ({"resid_dropout_p": 1.5}, "resid_dropout_p"), ({"multiple_of": 0}, "multiple_of")],
)
def test_bad_config(kw, match):
    with pytest.raises(InputError, match=match):
        tiny(**kw)


def test_bad_inputs():
    model = tiny()
    with pytest.raises(InputError, match="preset"):
        LlamaGenGPT.from_preset("XS")
    cache = model.new_cache(2, 24)
    with pytest.raises(InputError, match=r"class labels must lie in \[0, 10\]"):
        model.embed_condition(torch.tensor([1, 11]))
    with pytest.raises(InputError, match="integer class labels"):
        model.embed_condition(torch.tensor([1.0, 2.0]))
    with pytest.raises(InputError, match="drop_mask"):
        model.embed_condition(torch.tensor([1, 2]), torch.tensor([1, 0]))
    cond = model.embed_condition(torch.tensor([1, 2]))
    with pytest.raises(InputError, match="cond_embeddings"):
        model.prefill_condition(cond[:, :, :8], cache)
    with pytest.raises(InputError, match="cache does not fit"):
        model.prefill_condition(cond, model.new_cache(3, 24))
    model.prefill_condition(cond, cache)
    with pytest.raises(InputError, match="empty cache"):
        model.prefill_condition(cond, cache)
    bad = torch.tensor([[16], [17]])  # max_seq_len = 17: position 17 has no rotary row
    slots = cache.slots(1)
    with pytest.raises(InputError, match=r"positions must lie in \[0, 17\)"):
        model.forward_cached(torch.zeros(2, 1, dtype=torch.long), bad, cache, slots, cache.attention_mask(slots))
    with pytest.raises(InputError, match="mask"):
        model.forward_cached(torch.zeros(2, 1, dtype=torch.long), slots, cache, slots, torch.ones(2, 1, 5).bool())
    with pytest.raises(InputError, match="block_size"):
        model(torch.zeros(2, 17, dtype=torch.long), torch.tensor([1, 2]))
    t2i = tiny(model_type="t2i", cls_token_num=3)
    with pytest.raises(InputError, match=r"caption features \[B, 3, 8\]"):
        t2i.embed_condition(torch.randn(2, 4, 8))
    with pytest.raises(InputError, match="cond_mask"):
        t2i.prefill_condition(t2i.embed_condition(torch.randn(2, 3, 8)), t2i.new_cache(2, 24),
                              cond_mask=torch.ones(2, 4, dtype=torch.bool))


# --------------------------------------------------------------------------------------------------- docs
def test_docs_example_runs():
    doc = Path(__file__).resolve().parents[2] / "docs" / "llamagen.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(doc), "exec"), {"__name__": "__doc_example__"})
