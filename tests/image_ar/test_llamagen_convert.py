"""The LlamaGen GPT converter on synthetic checkpoints with the official key layout and containers.

`RefGPT` below is an independent, straightforward re-implementation of the official GPT forward written from
the published facts (fused wqkv, GQA by repeat_interleave, 2D RoPE as complex rotations with zeros at the
condition positions, SwiGLU, RMSNorm, c2i label / t2i caption embedders, t2i `emb_masks`). Its state dict has
the official key names; it is saved in the official containers, converted with `load_llamagen_gpt`, and the
converted model's logits must equal the reference's.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from image_ar.llamagen import LlamaGenGPT, infer_llamagen_config, load_llamagen_gpt
from mmspec.errors import CheckpointError, InputError


# ------------------------------------------------------------------------------------- reference model
class RefRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.weight


class RefAttention(nn.Module):
    def __init__(self, dim, n_head, n_kv_head):
        super().__init__()
        self.h, self.hkv, self.hd = n_head, n_kv_head, dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv_head) * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)


class RefFFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


class RefBlock(nn.Module):
    def __init__(self, dim, n_head, n_kv_head, hidden):
        super().__init__()
        self.attention = RefAttention(dim, n_head, n_kv_head)
        self.feed_forward = RefFFN(dim, hidden)
        self.attention_norm = RefRMSNorm(dim)
        self.ffn_norm = RefRMSNorm(dim)


class RefLabels(nn.Module):
    def __init__(self, num_classes, dim):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)


class RefCapProj(nn.Module):
    def __init__(self, caption_dim, dim):
        super().__init__()
        self.fc1 = nn.Linear(caption_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)


class RefCaptions(nn.Module):
    def __init__(self, caption_dim, dim, rows=120):
        super().__init__()
        self.cap_proj = RefCapProj(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(rows, caption_dim))  # official: 120 rows always


def ref_rotations(cls_token_num: int, grid: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Complex unit rotations [C + grid^2, head_dim // 2]: zeros at the condition positions, then per image
    token (row r, column c): head_dim // 4 row rotations followed by head_dim // 4 column rotations."""
    quarter = head_dim // 4
    inv = torch.tensor([base ** (-(2.0 * j) / (head_dim // 2)) for j in range(quarter)], dtype=torch.float64)
    rows = []
    for i in range(grid * grid):
        r, c = divmod(i, grid)
        rows.append(torch.cat([r * inv, c * inv]))
    angles = torch.stack(rows)  # [g*g, hd/2]
    image = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    return torch.cat([torch.zeros(cls_token_num, head_dim // 2, dtype=torch.complex64), image])


def rotate(x, rot):
    """x [B, L, H, D] real; rotate interleaved pairs (2j, 2j+1) as complex numbers by rot [L, D/2]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(-2)


class RefGPT(nn.Module):
    def __init__(self, *, vocab=64, dim=32, n_layer=2, n_head=4, n_kv_head=None, hidden=96, grid=4,
                 model_type="c2i", cls_token_num=1, num_classes=10, caption_dim=8):
        super().__init__()
        self.model_type, self.c, self.grid = model_type, cls_token_num, grid
        self.n_head, self.n_kv_head = n_head, n_kv_head or n_head
        if model_type == "c2i":
            self.cls_embedding = RefLabels(num_classes, dim)
        else:
            self.cls_embedding = RefCaptions(caption_dim, dim)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RefBlock(dim, n_head, self.n_kv_head, hidden) for _ in range(n_layer))
        self.norm = RefRMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.num_classes = num_classes
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
                elif "embedding" in name or "tok_embeddings" in name:
                    p.copy_(torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            if model_type == "t2i":
                uncond = self.cls_embedding.uncond_embedding
                uncond.copy_(torch.randn(uncond.shape, generator=g))

    def embed(self, cond, dropped=None):
        if self.model_type == "c2i":
            labels = cond if dropped is None else torch.where(dropped, self.num_classes, cond)
            return self.cls_embedding.embedding_table(labels)[:, None]
        caption = cond
        if dropped is not None:
            uncond = self.cls_embedding.uncond_embedding[: cond.shape[1]]
            caption = torch.where(dropped[:, None, None], uncond, cond)
        proj = self.cls_embedding.cap_proj
        return proj.fc2(F.gelu(proj.fc1(caption), approximate="tanh"))[:, : self.c]

    def forward(self, idx, cond, dropped=None, emb_mask=None):
        """Teacher forcing: logits [B, T, V] for inputs [cond, idx[:, :-1]] (official training forward)."""
        x = torch.cat([self.embed(cond, dropped), self.tok_embeddings(idx[:, :-1])], 1)
        b, length, dim = x.shape
        allowed = torch.tril(torch.ones(length, length)).expand(b, length, length).clone()
        if emb_mask is not None:  # the official dataset / generate(): hide padded caption keys, keep the diagonal
            allowed[:, :, : self.c] *= emb_mask[:, None, :].float()
            eye = torch.eye(length)
            allowed = allowed * (1 - eye) + eye
        rot = ref_rotations(self.c, self.grid, dim // self.n_head)[:length]
        for layer in self.layers:
            a = layer.attention
            qkv = a.wqkv(layer.attention_norm(x))
            q, k, v = torch.split(qkv, [a.h * a.hd, a.hkv * a.hd, a.hkv * a.hd], -1)
            q = rotate(q.reshape(b, length, a.h, a.hd), rot).transpose(1, 2)
            k = rotate(k.reshape(b, length, a.hkv, a.hd), rot).transpose(1, 2)
            v = v.reshape(b, length, a.hkv, a.hd).transpose(1, 2)
            k = k.repeat_interleave(a.h // a.hkv, 1)
            v = v.repeat_interleave(a.h // a.hkv, 1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(a.hd)
            scores = scores.masked_fill(allowed[:, None] == 0, float("-inf"))
            out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, dim)
            x = x + a.wo(out)
            f = layer.feed_forward
            hn = layer.ffn_norm(x)
            x = x + f.w2(F.silu(f.w1(hn)) * f.w3(hn))
        return self.output(self.norm(x))[:, self.c - 1 :]


def official_sd(ref: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ref.state_dict().items()}


# ------------------------------------------------------------------------------------------------ tests
C2I = dict(vocab=64, dim=32, n_layer=2, n_head=4, hidden=96, grid=4, num_classes=10)
T2I = dict(vocab=48, dim=32, n_layer=2, n_head=4, n_kv_head=2, hidden=96, grid=4, model_type="t2i",
           cls_token_num=4, caption_dim=8)


def _save(obj, path):
    torch.save(obj, path)
    return path


CONTAINERS = {
    "model+training-state": lambda sd: {"model": sd, "optimizer": {"state": {}, "param_groups": []}, "steps": 7,
                                        "args": argparse.Namespace(gpt_model="GPT-tiny", lr=1e-4)},
    "module": lambda sd: {"module": sd},
    "state_dict": lambda sd: {"state_dict": sd},
    "raw": lambda sd: sd,
    "ddp-prefix": lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}},
}


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_c2i_logits_match_reference(tmp_path, container):
    torch.manual_seed(0)
    ref = RefGPT(**C2I).eval()
    path = _save(CONTAINERS[container](official_sd(ref)), tmp_path / "c2i_tiny_64.pt")
    model = load_llamagen_gpt(path, n_head=4)
    cfg = model.config
    assert (cfg.vocab_size, cfg.dim, cfg.n_layer, cfg.n_head, cfg.n_kv_head) == (64, 32, 2, 4, None)
    assert (cfg.block_size, cfg.model_type, cfg.num_classes, cfg.cls_token_num) == (16, "c2i", 10, 1)
    assert (cfg.multiple_of, cfg.ffn_dim_multiplier) == (32, None)  # reproduces the 96-wide SwiGLU
    assert not model.training and model.output.weight.dtype == torch.float32
    idx = torch.randint(0, 64, (3, 16))
    labels = torch.tensor([0, 9, 4])
    with torch.no_grad():
        expected = ref(idx, labels)
        got = model(idx, labels).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        dropped = torch.tensor([True, False, True])  # CFG null class
        torch.testing.assert_close(model(idx, labels, drop_mask=dropped).logits, ref(idx, labels, dropped),
                                   atol=1e-5, rtol=1e-5)


def test_t2i_logits_match_reference_with_padding_mask_and_uncond(tmp_path):
    torch.manual_seed(1)
    ref = RefGPT(**T2I).eval()
    path = _save({"model": official_sd(ref)}, tmp_path / "t2i_tiny_stage1_64.pt")
    # official CaptionEmbedder allocates 120 uncond rows whatever cls_token_num is: the tiny model uses 4
    model = load_llamagen_gpt(path, n_head=4, cls_token_num=4)
    cfg = model.config
    assert (cfg.model_type, cfg.caption_dim, cfg.n_kv_head, cfg.cls_token_num, cfg.block_size) == ("t2i", 8, 2, 4, 16)
    idx = torch.randint(0, 48, (3, 16))
    caption = torch.randn(3, 4, 8)
    emb_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)  # left padding
    caption = caption * emb_mask[..., None]  # the official sampler zeroes the padding
    dropped = torch.tensor([False, True, False])
    with torch.no_grad():
        torch.testing.assert_close(model(idx, caption).logits, ref(idx, caption), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(idx, caption, cond_mask=emb_mask, drop_mask=dropped).logits,
                                   ref(idx, caption, dropped, emb_mask), atol=1e-5, rtol=1e-5)


def test_t2i_cached_generation_with_padding_matches_reference(tmp_path):
    torch.manual_seed(2)
    ref = RefGPT(**T2I).eval()
    path = _save({"model": official_sd(ref)}, tmp_path / "t2i_tiny_stage1_64.pt")
    model = load_llamagen_gpt(path, n_head=4, cls_token_num=4)
    idx = torch.randint(0, 48, (2, 16))
    caption = torch.randn(2, 4, 8)
    emb_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    expected = ref(idx, caption, emb_mask=emb_mask)  # [B, 16, V]
    cache = model.new_cache(2, 24)
    got = [model.prefill_condition(model.embed_condition(caption), cache, cond_mask=emb_mask)]
    for i in range(15):
        slots = cache.slots(1)
        got.append(model.forward_cached(idx[:, i : i + 1], slots, cache, slots, cache.attention_mask(slots))[:, 0])
        cache.commit_chain(torch.ones(2, dtype=torch.long))
    torch.testing.assert_close(torch.stack(got, 1), expected, atol=1e-5, rtol=1e-5)


def test_ignored_keys_are_skipped(tmp_path):
    ref = RefGPT(**C2I)
    sd = official_sd(ref)
    sd["freqs_cis"] = torch.zeros(17, 4, 2)
    sd["layers.0.attention.kv_cache.k_cache"] = torch.zeros(1, 4, 24, 8)
    sd["layers.0.attention.kv_cache.v_cache"] = torch.zeros(1, 4, 24, 8)
    model = load_llamagen_gpt(_save({"model": sd}, tmp_path / "c2i_tiny_64.pt"), n_head=4)
    assert torch.equal(model.tok_embeddings.weight, sd["tok_embeddings.weight"])


def test_ema_weights_with_prefer(tmp_path):
    ref = RefGPT(**C2I)
    sd = official_sd(ref)
    ema = {k: v + 1 for k, v in sd.items()}
    path = _save({"model": sd, "ema": ema}, tmp_path / "c2i_tiny_64.pt")
    assert torch.equal(load_llamagen_gpt(path, n_head=4).norm.weight, sd["norm.weight"])
    assert torch.equal(load_llamagen_gpt(path, n_head=4, prefer="ema").norm.weight, ema["norm.weight"])


def test_missing_key_and_wrong_shape_give_one_error(tmp_path):
    sd = official_sd(RefGPT(**C2I))
    del sd["layers.1.feed_forward.w3.weight"]
    sd["norm.weight"] = torch.ones(33)
    sd["layers.0.attention.bias"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as err:
        load_llamagen_gpt(_save({"model": sd}, tmp_path / "c2i_tiny_64.pt"), n_head=4)
    msg = str(err.value)
    assert "layers.1.feed_forward.w3.weight" in msg
    assert "norm.weight: checkpoint shape [33] vs model shape [32]" in msg
    assert "layers.0.attention.bias" in msg


def test_config_mismatch_lists_shapes(tmp_path):
    path = _save({"model": official_sd(RefGPT(**C2I))}, tmp_path / "c2i_tiny_64.pt")
    with pytest.raises(CheckpointError, match=r"wqkv\.weight: checkpoint shape \[96, 32\] vs model shape \[64, 32\]"):
        load_llamagen_gpt(path, {"n_head": 4, "n_kv_head": 2})


def test_unknown_size_needs_n_head(tmp_path):
    path = _save({"model": official_sd(RefGPT(**C2I))}, tmp_path / "c2i_tiny_64.pt")
    with pytest.raises(CheckpointError, match="n_head"):
        load_llamagen_gpt(path)


def test_not_a_gpt_checkpoint(tmp_path):
    path = _save({"model": {"encoder.conv_in.weight": torch.zeros(3)}}, tmp_path / "vq_ds16_c2i.pt")
    with pytest.raises(CheckpointError, match="tok_embeddings.weight"):
        load_llamagen_gpt(path)


def test_block_size_without_resolution_warns_and_override_wins(tmp_path):
    path = _save(official_sd(RefGPT(**C2I)), tmp_path / "consolidated.pth")
    with pytest.warns(UserWarning, match="block_size"):
        cfg = infer_llamagen_config(torch.load(path), "consolidated.pth", n_head=4)
    assert cfg["block_size"] == 256
    model = load_llamagen_gpt(path, n_head=4, block_size=16)
    assert model.config.block_size == 16


def test_bad_arguments(tmp_path):
    path = _save({"model": official_sd(RefGPT(**C2I))}, tmp_path / "c2i_tiny_64.pt")
    with pytest.raises(InputError, match="unknown LlamaGenGPT config"):
        load_llamagen_gpt(path, n_head=4, heads=4)
    with pytest.raises(InputError, match="preset"):
        load_llamagen_gpt(path, "Huge")
    with pytest.raises(InputError, match="dtype"):
        load_llamagen_gpt(path, n_head=4, dtype=torch.int64)


def test_dtype_option(tmp_path):
    path = _save({"model": official_sd(RefGPT(**C2I))}, tmp_path / "c2i_tiny_64.pt")
    model = load_llamagen_gpt(path, n_head=4, dtype=torch.bfloat16)
    assert model.output.weight.dtype == torch.bfloat16
    assert model(torch.zeros(1, 4, dtype=torch.long), torch.tensor([1])).logits.dtype == torch.float32


@pytest.mark.parametrize(
    "name, preset, model_type, block_size",
    [("c2i_B_256.pt", "B", "c2i", 256), ("c2i_L_384.pt", "L", "c2i", 576), ("c2i_XL_384.pt", "XL", "c2i", 576),
     ("c2i_XXL_384.pt", "XXL", "c2i", 576), ("c2i_3B_384.pt", "3B", "c2i", 576),
     ("t2i_XL_stage1_256.pt", "XL", "t2i", 256), ("t2i_XL_stage2_512.pt", "XL", "t2i", 1024)],
)
def test_infer_official_configs_from_shapes(name, preset, model_type, block_size):
    """Shapes of the official files (meta tensors: nothing allocated) give back the official config."""
    kwargs = {"model_type": model_type, "block_size": block_size}
    if model_type == "t2i":
        kwargs["cls_token_num"] = 120
    with torch.device("meta"):
        sd = LlamaGenGPT.from_preset(preset, **kwargs).state_dict()
    cfg = infer_llamagen_config(sd, name)
    n_layer, n_head, dim = {"B": (12, 12, 768), "L": (24, 16, 1024), "XL": (36, 20, 1280),
                            "XXL": (48, 24, 1536), "3B": (24, 32, 3200)}[preset]
    assert (cfg["n_layer"], cfg["n_head"], cfg["dim"], cfg["n_kv_head"]) == (n_layer, n_head, dim, None)
    assert (cfg["vocab_size"], cfg["model_type"], cfg["block_size"]) == (16384, model_type, block_size)
    assert "multiple_of" not in cfg and "ffn_dim_multiplier" not in cfg  # official 256 / None
    if model_type == "c2i":
        assert (cfg["num_classes"], cfg["cls_token_num"]) == (1000, 1)
    else:
        assert (cfg["caption_dim"], cfg["cls_token_num"]) == (2048, 120)
