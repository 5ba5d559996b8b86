"""Tests for the LlamaGen VQ tokenizer (`image_ar.llamagen.vq`), its converter and its training loss.

The converter is proven on synthetic checkpoints: `RefVQ` below is an independent re-implementation of the
official VQ forward (LlamaGen `vq_model.py`, written from the published facts, with the official module names,
bmm attention and a brute-force nearest-code search), saved with `torch.save` in the official container
`{'model': state_dict}`. Everything uses tiny configs (ch 32, 64 codes, 16x16 / 32x32 images).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from vq_reference import RefAttn, RefDown, RefRes, RefUp, gn, swish

from image_ar.llamagen.convert_vq import (
    convert_llamagen_vq,
    infer_llamagen_vq_config,
    load_llamagen_vq,
    main,
)
from image_ar.llamagen.vq import LlamaGenVQ, LlamaGenVQOutput, VQLosses
from image_ar.llamagen.vq_train import VQLossWeights, gradient_loss, vq_loss
from mmspec.errors import CheckpointError, InputError

DOC = Path(__file__).resolve().parents[2] / "docs" / "llamagen_vq.md"
ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny convolutions run ~100x slower with 2 intra-op threads on a busy 2-core machine; use one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------ independent reference model
def ref_level(cin: int, cout: int, n_res: int, with_attn: bool, groups: int, resample: str | None, c: int):
    level = nn.Module()
    level.res = nn.ModuleList([RefRes(cin if j == 0 else cout, cout, groups) for j in range(n_res)])
    level.attn = nn.ModuleList([RefAttn(cout, groups) for _ in range(n_res)] if with_attn else [])
    if resample == "down":
        level.downsample = RefDown(cout)
    elif resample == "up":
        level.upsample = RefUp(cout)
    return level


def run_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for j, res in enumerate(level.res):
        h = res(h)
        if len(level.attn):
            h = level.attn[j](h)
    for name in ("downsample", "upsample"):
        if hasattr(level, name):
            h = getattr(level, name)(h)
    return h


class RefVQ(nn.Module):
    """Official VQModel semantics: Encoder -> quant_conv -> L2-normalised nearest code -> post_quant_conv -> Decoder."""

    def __init__(self, ch=32, ch_mult=(1, 2, 2), n_res=1, z=16, n_codes=64, dim=8, groups=8):
        super().__init__()
        last = len(ch_mult) - 1
        enc = nn.Module()
        enc.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        enc.conv_blocks = nn.ModuleList()
        cin = ch
        for i, m in enumerate(ch_mult):
            enc.conv_blocks.append(ref_level(cin, ch * m, n_res, i == last, groups, "down" if i != last else None, ch))
            cin = ch * m
        enc.mid = nn.ModuleList([RefRes(cin, cin, groups), RefAttn(cin, groups), RefRes(cin, cin, groups)])
        enc.norm_out, enc.conv_out = gn(cin, groups), nn.Conv2d(cin, z, 3, padding=1)
        self.encoder = enc

        dec = nn.Module()
        cin = ch * ch_mult[last]
        dec.conv_in = nn.Conv2d(z, cin, 3, padding=1)
        dec.mid = nn.ModuleList([RefRes(cin, cin, groups), RefAttn(cin, groups), RefRes(cin, cin, groups)])
        dec.conv_blocks = nn.ModuleList()
        for i in reversed(range(len(ch_mult))):
            dec.conv_blocks.append(ref_level(cin, ch * ch_mult[i], n_res + 1, i == last, groups,
                                             "up" if i != 0 else None, ch))
            cin = ch * ch_mult[i]
        dec.norm_out, dec.conv_out = gn(cin, groups), nn.Conv2d(cin, 3, 3, padding=1)
        self.decoder = dec

        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(n_codes, dim)
        self.quantize.register_buffer("codebook_used", torch.zeros(65536))
        self.quant_conv, self.post_quant_conv = nn.Conv2d(z, dim, 1), nn.Conv2d(dim, z, 1)

    def encode(self, x):
        e = self.encoder
        h = e.conv_in(x)
        for level in e.conv_blocks:
            h = run_level(level, h)
        for block in e.mid:
            h = block(h)
        h = self.quant_conv(e.conv_out(swish(e.norm_out(h))))  # [B, C, h, w]
        b, c, hh, ww = h.shape
        zf = F.normalize(h.permute(0, 2, 3, 1).reshape(-1, c), dim=-1)  # [N, C]
        codes = F.normalize(self.quantize.embedding.weight, dim=-1)  # [V, C]
        ids = ((zf[:, None, :] - codes[None]) ** 2).sum(-1).argmin(-1)  # [N] brute force
        zq = codes[ids].reshape(b, hh, ww, c).permute(0, 3, 1, 2)
        return zq, ids.reshape(b, hh, ww)

    def decode_code(self, ids, shape):
        b, c, hh, ww = shape
        zq = F.normalize(self.quantize.embedding.weight, dim=-1)[ids.reshape(-1)]
        h = self.post_quant_conv(zq.reshape(b, hh, ww, c).permute(0, 3, 1, 2))
        d = self.decoder
        h = d.conv_in(h)
        for block in d.mid:
            h = block(h)
        for level in d.conv_blocks:
            h = run_level(level, h)
        return d.conv_out(swish(d.norm_out(h)))


REF_CONFIGS = {
    4: {"ch_mult": (1, 2, 2), "size": 16},  # 4x4 tokens
    8: {"ch_mult": (1, 1, 2, 2), "size": 32},  # 4x4 tokens
}


def make_ref(ds: int, seed: int = 0) -> RefVQ:
    torch.manual_seed(seed)
    ref = RefVQ(ch_mult=REF_CONFIGS[ds]["ch_mult"]).eval()
    with torch.no_grad():  # move GroupNorm affines and biases off their defaults so a swap would show
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return ref


def images(b: int, size: int, seed: int = 1, width: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 3, size, width or size, generator=g) * 2 - 1


@pytest.fixture(scope="module", params=[4, 8])
def official_file(request, tmp_path_factory):
    ds = request.param
    ref = make_ref(ds)
    path = tmp_path_factory.mktemp(f"llamagen_vq_ds{ds}") / "vq_tiny.pt"
    torch.save({"model": ref.state_dict()}, path)
    return ds, ref, path


# --------------------------------------------------------------------------------------------- converter
def test_converter_matches_reference(official_file):
    ds, ref, path = official_file
    vq = load_llamagen_vq(path, norm_num_groups=8)
    assert not vq.training
    assert vq.downsample_factor == ds
    assert list(vq.config.encoder_ch_mult) == list(REF_CONFIGS[ds]["ch_mult"])
    x = images(2, REF_CONFIGS[ds]["size"])
    with torch.no_grad():
        ref_latents, ref_ids = ref.encode(x)
        latents, ids, losses = vq.encode(x)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(latents, ref_latents, atol=ATOL, rtol=0)
        shape = [2, 8, *ids.shape[1:]]  # the official call: decode_code(idx, [B, 8, h, w])
        want = ref.decode_code(ref_ids, shape)
        torch.testing.assert_close(vq.decode_code(ids.reshape(2, -1), shape=shape), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(vq.decode_code(ids), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(vq.decode_code(ids.reshape(-1), shape=shape), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(vq.decode(latents), want, atol=ATOL, rtol=0)
        assert torch.equal(vq.quantize_ids(x), ref_ids.reshape(2, -1))
        assert torch.isfinite(losses.total)


def test_inferred_config(official_file):
    ds, ref, _ = official_file
    cfg = infer_llamagen_vq_config(ref.state_dict())
    mult = list(REF_CONFIGS[ds]["ch_mult"])
    assert cfg == {
        "codebook_size": 64, "codebook_embed_dim": 8, "codebook_show_usage": True, "encoder_ch_mult": mult,
        "decoder_ch_mult": mult, "z_channels": 16, "in_channels": 3, "out_channels": 3, "ch": 32,
        "num_res_blocks": 1,
    }


@pytest.mark.parametrize("container", ["ema", "state_dict", "raw", "training", "safetensors"])
def test_converter_containers(tmp_path, container):
    ref = make_ref(4)
    sd = ref.state_dict()
    other = {k: torch.zeros_like(v) for k, v in sd.items()}
    objs = {
        "ema": {"ema": sd, "model": other},  # the official demo scripts prefer 'ema'
        "state_dict": {"state_dict": sd},
        "raw": sd,
        "training": {  # what the official vq_train.py saves
            "model": sd, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]},
            "discriminator": {"conv.weight": torch.zeros(2, 2)}, "optimizer_disc": {"state": {}}, "steps": 5000,
            "args": argparse.Namespace(vq_model="VQ-16", codebook_size=64),
        },
    }
    if container == "safetensors":
        path = tmp_path / "vq.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:
        path = tmp_path / "vq.pt"
        torch.save(objs[container], path)
    vq = load_llamagen_vq(path, norm_num_groups=8)
    x = images(1, 16)
    with torch.no_grad():
        assert torch.equal(vq.encode(x).ids, ref.encode(x)[1])


def test_converter_model_key_skips_ema(tmp_path):
    ref = make_ref(4)
    path = tmp_path / "vq.pt"
    torch.save({"ema": {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}, "model": ref.state_dict()},
               path)
    vq = load_llamagen_vq(path, prefer="model", norm_num_groups=8)
    assert torch.equal(vq.quantize.embedding.weight, ref.quantize.embedding.weight)


def test_converter_config_forms_and_usage_buffer(tmp_path):
    ref = make_ref(4)
    sd = ref.state_dict()
    sd_no_usage = {k: v for k, v in sd.items() if k != "quantize.codebook_used"}
    path = tmp_path / "vq.pt"
    torch.save({"model": sd_no_usage}, path)
    vq = load_llamagen_vq(path, norm_num_groups=8)  # the buffer may be absent ...
    assert not vq.config.codebook_show_usage and "quantize.codebook_used" not in vq.state_dict()
    cfg = dict(vq.config)
    vq2 = load_llamagen_vq(path, config=cfg, codebook_show_usage=True)  # ... or present in the model only
    assert vq2.quantize.codebook_used.abs().sum() == 0
    torch.save({"model": sd}, path)
    vq3 = load_llamagen_vq(path, config=cfg)  # ... or present in the file only
    assert "quantize.codebook_used" not in vq3.state_dict()
    vq4 = load_llamagen_vq(path, dtype=torch.float64, norm_num_groups=8)
    assert vq4.dtype == torch.float64


def test_converter_preset_mismatch_lists_shapes(tmp_path):
    path = tmp_path / "vq_ds16_c2i.pt"
    torch.save({"model": make_ref(4).state_dict()}, path)
    with pytest.raises(CheckpointError) as err:
        load_llamagen_vq(path, config="vq_16", codebook_size=64, z_channels=16, ch=32, num_res_blocks=1,
                         norm_num_groups=8)
    msg = str(err.value)
    assert "missing from the checkpoint" in msg and "encoder.conv_blocks.4.res.0.conv1.weight" in msg
    assert "shape mismatch" in msg and "encoder.conv_blocks.1.res.0.conv1.weight" in msg
    with pytest.warns(UserWarning, match="downsample 16"):  # the file name says ds16, the weights ds4
        load_llamagen_vq(path, norm_num_groups=8)


def test_converter_missing_and_wrong_shape_keys(tmp_path):
    ref = make_ref(4)
    sd = dict(ref.state_dict())
    del sd["decoder.conv_blocks.0.attn.1.q.weight"]
    sd["post_quant_conv.weight"] = torch.zeros(16, 8, 3, 3)
    sd["extra.weight"] = torch.zeros(1)
    path = tmp_path / "vq.pt"
    torch.save({"model": sd}, path)
    with pytest.raises(CheckpointError) as err:
        load_llamagen_vq(path, norm_num_groups=8)
    msg = str(err.value)
    assert "decoder.conv_blocks.0.attn.1.q.weight" in msg
    assert re.search(r"post_quant_conv\.weight: checkpoint shape \[16, 8, 3, 3\] vs model shape \[16, 8, 1, 1\]", msg)
    assert "extra.weight" in msg


def test_converter_rejects_non_vq_and_unknown_groups(tmp_path):
    path = tmp_path / "gpt.pt"
    torch.save({"model": {"tok_embeddings.weight": torch.zeros(4, 2)}}, path)
    with pytest.raises(CheckpointError, match="Not a LlamaGen VQ"):
        load_llamagen_vq(path)
    torch.manual_seed(0)
    small = RefVQ(ch=16, ch_mult=(1, 2), groups=4)  # widths 16, 32: cannot be official GroupNorm(32)
    torch.save({"model": small.state_dict()}, path)
    with pytest.raises(InputError, match="norm_num_groups"):
        load_llamagen_vq(path)
    assert load_llamagen_vq(path, norm_num_groups=4).config.ch == 16
    with pytest.raises(InputError, match="preset"):
        load_llamagen_vq(path, config="vq_32")
    with pytest.raises(InputError, match="Valid fields"):
        load_llamagen_vq(path, norm_num_groups=4, not_a_field=1)


def test_convert_cli_and_from_pretrained(official_file, tmp_path):
    ds, ref, path = official_file
    out = tmp_path / "converted"
    assert main([str(path), str(out), "--norm-num-groups", "8"]) == 0
    vq = LlamaGenVQ.from_pretrained(out).eval()
    x = images(1, REF_CONFIGS[ds]["size"])
    with torch.no_grad():
        assert torch.equal(vq.encode(x).ids, ref.encode(x)[1])
    model = convert_llamagen_vq(path, tmp_path / "again", norm_num_groups=8)
    assert isinstance(model, LlamaGenVQ)


# ------------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("ds", [4, 8, 16])
def test_decode_code_round_trip_shapes(ds):
    torch.manual_seed(0)
    vq = LlamaGenVQ.tiny(ds).eval()
    assert vq.downsample_factor == ds
    x = images(2, 32)
    g = 32 // ds
    with torch.no_grad():
        latents, ids, _ = vq.encode(x)
        assert latents.shape == (2, 8, g, g) and ids.shape == (2, g, g) and ids.dtype == torch.int64
        flat = vq.quantize_ids(x)
        assert flat.shape == (2, g * g) and torch.equal(flat, ids.reshape(2, -1))
        out = vq.decode_code(flat)
        assert out.shape == (2, 3, 32, 32)
        assert torch.equal(latents, vq.codebook()[ids].permute(0, 3, 1, 2))  # no autograd: exactly the codes
        torch.testing.assert_close(out, vq.decode(latents), atol=1e-6, rtol=0)
        assert vq.decode_code(flat, clamp=True).abs().max() <= 1
        result = vq(x)
        assert isinstance(result, LlamaGenVQOutput) and result.sample.shape == x.shape
        assert vq.token_grid(64, 32) == (64 // ds, 32 // ds)


def test_non_square_grid():
    torch.manual_seed(0)
    vq = LlamaGenVQ.tiny(8).eval()
    x = images(1, 32, width=16)
    with torch.no_grad():
        ids = vq.encode(x).ids
        assert ids.shape == (1, 4, 2)
        out = vq.decode_code(ids.reshape(1, -1), shape=(1, 8, 4, 2))
        assert out.shape == (1, 3, 32, 16)
        torch.testing.assert_close(out, vq.decode_code(ids), atol=0, rtol=0)
        with pytest.raises(InputError, match="not a square grid"):
            vq.decode_code(ids.reshape(1, -1))


def test_codebook_l2_normalised():
    torch.manual_seed(0)
    vq = LlamaGenVQ.tiny(4)
    with torch.no_grad():
        vq.quantize.embedding.weight.mul_(torch.rand(256, 1) * 5 + 0.1)  # rows of any length
    book = vq.codebook()
    assert book.shape == (256, 8)
    torch.testing.assert_close(book.norm(dim=-1), torch.ones(256))
    latents = vq.eval().encode(images(1, 16)).latents
    torch.testing.assert_close(latents.norm(dim=1), torch.ones(1, 4, 4))  # quantized vectors are codes
    raw = LlamaGenVQ.tiny(4, codebook_l2_norm=False)
    assert torch.equal(raw.codebook(), raw.quantize.embedding.weight)


def test_nearest_code_hand_made():
    vq = LlamaGenVQ.tiny(4, codebook_size=4, codebook_embed_dim=2).eval()
    with torch.no_grad():
        vq.quantize.embedding.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]))
    # z [1, 2, 1, 3]: directions ~0 deg, ~270 deg, ~170 deg; the magnitudes must not matter (L2 norm)
    z = torch.tensor([[2.0, 0.1], [-0.1, -3.0], [-5.0, 1.0]]).t().reshape(1, 2, 1, 3)
    zq, ids, _ = vq.quantize(z)
    assert ids.tolist() == [[[0, 3, 2]]]
    torch.testing.assert_close(zq[0, :, 0].t(), torch.tensor([[1.0, 0.0], [0.0, -1.0], [-1.0, 0.0]]))
    # without L2 normalisation it is plain Euclidean distance: (0.1, 0.05) is nearest (0, 0.5) although its
    # direction is nearest that of (10, 10)
    plain = LlamaGenVQ.tiny(4, codebook_size=3, codebook_embed_dim=2, codebook_l2_norm=False).eval()
    with torch.no_grad():
        plain.quantize.embedding.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.5], [10.0, 10.0]]))
    z = torch.tensor([[0.6, 0.0], [0.1, 0.05], [6.0, 7.0]]).t().reshape(1, 2, 1, 3)
    assert plain.quantize(z)[1].tolist() == [[[0, 1, 2]]]


def test_straight_through_gradient_and_losses():
    torch.manual_seed(0)
    vq = LlamaGenVQ.tiny(4, entropy_loss_ratio=0.1, dropout_p=0.1).train()
    x = images(2, 16)
    out = vq(x)
    assert isinstance(out.losses, VQLosses) and out.losses.codebook_usage is not None
    loss, logs = vq_loss(out, x, VQLossWeights(l1=0.5, gradient=0.5))
    assert torch.isfinite(loss)
    assert set(logs) == {"loss", "l2", "l1", "gradient", "codebook_loss", "commit_loss", "entropy_loss",
                         "codebook_usage"}
    assert all(torch.isfinite(v) for v in logs.values())
    loss.backward()
    for name in ("encoder.conv_in.weight", "quant_conv.weight", "quantize.embedding.weight",
                 "decoder.conv_out.weight"):
        grad = dict(vq.named_parameters())[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name

    # the estimator itself: d z_q / d z is the identity (without the L2 normalisation in between)
    plain = LlamaGenVQ.tiny(4, codebook_l2_norm=False)
    z = torch.randn(2, 8, 3, 3, requires_grad=True)
    g = torch.randn(2, 8, 3, 3)
    zq, _, losses = plain.quantize(z)
    (zq * g).sum().backward()
    torch.testing.assert_close(z.grad, g)
    assert losses.entropy_loss == 0


def test_usage_window_and_tuple_output():
    torch.manual_seed(0)
    vq = LlamaGenVQ.tiny(4).train()
    x = images(2, 16)
    sample, losses = vq(x, return_dict=False)
    ids = vq.encode(x).ids.reshape(-1)
    window = vq.quantize.codebook_used
    assert torch.equal(window[-ids.numel():], ids.float())
    assert losses.codebook_usage == pytest.approx(len(torch.unique(window)) / 256)
    loss, logs = vq_loss((sample, losses), x, {"l2": 1.0, "l1": 0.0})
    assert torch.isfinite(loss) and "codebook_usage" in logs
    assert gradient_loss(x, x) == 0


def test_save_pretrained_round_trip(tmp_path):
    torch.manual_seed(0)
    vq = LlamaGenVQ.tiny(8).eval()
    vq.save_pretrained(tmp_path)
    again = LlamaGenVQ.from_pretrained(tmp_path).eval()
    def as_lists(cfg):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items() if not k.startswith("_")}

    assert as_lists(again.config) == as_lists(vq.config)
    for k, v in vq.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    x = images(1, 32)
    with torch.no_grad():
        torch.testing.assert_close(again(x).sample, vq(x).sample, atol=0, rtol=0)


def test_preset_parameter_counts_on_meta():
    with torch.device("meta"):
        vq16 = LlamaGenVQ.vq_16()
        vq8 = LlamaGenVQ.vq_8()
    n16 = sum(p.numel() for p in vq16.parameters())
    n8 = sum(p.numel() for p in vq8.parameters())
    assert n16 == 71_883_403 and round(n16 / 1e6) == 72  # README: vq_ds16 72M
    assert n8 == 70_109_835 and round(n8 / 1e6) == 70  # README: vq_ds8 70M
    assert vq16.downsample_factor == 16 and vq8.downsample_factor == 8
    assert vq16.quantize.embedding.weight.shape == (16384, 8) and vq16.quantize.embedding.weight.is_meta
    assert vq16.config.norm_num_groups == 32 and vq16.config.ch == 128 and vq16.config.z_channels == 256
    assert len(vq16.decoder.conv_blocks[0].res) == 3 and len(vq16.encoder.conv_blocks[0].res) == 2


# ------------------------------------------------------------------------------------------------ errors
def test_input_errors():
    vq = LlamaGenVQ.tiny(8).eval()
    with pytest.raises(InputError, match="multiple of the downsample factor 8"):
        vq.encode(torch.zeros(1, 3, 20, 16))
    with pytest.raises(InputError, match=r"images must be in \[-1, 1\]"):
        vq.encode(torch.full((1, 3, 16, 16), 200.0))
    vq.encode(torch.full((1, 3, 16, 16), 1.5), check_range=False)  # the check can be skipped
    with pytest.raises(InputError, match="uint8"):
        vq.encode(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))
    with pytest.raises(InputError, match=r"\[B, 3, H, W\]"):
        vq.encode(torch.zeros(3, 16, 16))
    with pytest.raises(InputError, match=r"ids must be in \[0, 256\)"):
        vq.decode_code(torch.full((1, 4), 256))
    with pytest.raises(InputError, match="integer"):
        vq.decode_code(torch.zeros(1, 4))
    with pytest.raises(InputError, match="shape"):
        vq.decode_code(torch.zeros(4, dtype=torch.long))
    with pytest.raises(InputError, match="B\\*h\\*w"):
        vq.decode_code(torch.zeros(1, 4, dtype=torch.long), shape=(1, 8, 3, 3))
    with pytest.raises(InputError, match="codebook_embed_dim"):
        vq.decode(torch.zeros(1, 4, 2, 2))
    with pytest.raises(InputError, match="norm_num_groups"):
        LlamaGenVQ.tiny(8, norm_num_groups=32, ch=16)
    with pytest.raises(InputError, match="same length"):
        LlamaGenVQ.tiny(8, decoder_ch_mult=(1, 2))
    with pytest.raises(InputError, match="preset"):
        LlamaGenVQ.from_preset("vq_32")
    with pytest.raises(InputError, match="downsample_factor"):
        LlamaGenVQ.tiny(32)
    with pytest.raises(InputError, match="VQLossWeights.l1"):
        VQLossWeights(l1=-1)
    with pytest.raises(InputError, match="unknown term"):
        vq_loss(vq(torch.zeros(1, 3, 16, 16)), torch.zeros(1, 3, 16, 16), {"lpips": 1.0})


def test_doc_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {"__name__": "__doc_example__"})


@pytest.mark.parametrize("preset, ch_mult", [("vq_16", (1, 1, 2, 2, 4)), ("vq_8", (1, 2, 2, 4))])
def test_official_size_key_layout_and_inference_on_meta(preset, ch_mult):
    """The full-size reference (official sizes) has exactly the preset's keys and shapes; inference recovers it."""
    with torch.device("meta"):
        ref = RefVQ(ch=128, ch_mult=ch_mult, n_res=2, z=256, n_codes=16384, dim=8, groups=32)
        vq = LlamaGenVQ.from_preset(preset)
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in vq.state_dict().items()}
    assert got == want
    cfg = infer_llamagen_vq_config(ref.state_dict())
    assert cfg["encoder_ch_mult"] == cfg["decoder_ch_mult"] == list(ch_mult)
    assert (cfg["ch"], cfg["num_res_blocks"], cfg["z_channels"], cfg["codebook_size"]) == (128, 2, 256, 16384)
