"""MoVQGAN (`image_ar.movqgan`), Lumina-mGPT 2.0's image tokenizer: its converter on a synthetic official checkpoint
made from an independent reference written here from the published facts (taming's encoder and the MoVQ decoder
whose norms are spatial: GroupNorm(f) * conv_y(zq') + conv_b(zq'), under the official names), and, when
$MMSPEC_LUMINA_MGPT2_REPO names an extracted `lumina_mgpt` folder of Alpha-VLLM/Lumina-mGPT-2.0, its own
`Encoder` and `MOVQDecoder`. Tiny configs: ch 32, ch_mult (1, 2), 64 codes of 4, 16 x 16 images (8 x 8 codes)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from vq_reference import RefAttn, RefDown, RefRes, RefUp, gn, swish

from image_ar.movqgan import MoVQGAN, load_movqgan
from mmspec.errors import CheckpointError

CH, MULT, N_RES, Z, CODES, DIM = 32, (1, 2), 1, 4, 64, 4


class RefSpatialNorm(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm_layer, self.conv_y, self.conv_b = gn(c, 32), nn.Conv2d(DIM, c, 1), nn.Conv2d(DIM, c, 1)

    def forward(self, f, zq):
        zq = F.interpolate(zq, size=f.shape[-2:], mode="nearest")
        return self.norm_layer(f) * self.conv_y(zq) + self.conv_b(zq)


class RefSpatialRes(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = RefSpatialNorm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = RefSpatialNorm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x, zq):
        h = self.conv2(swish(self.norm2(self.conv1(swish(self.norm1(x, zq))), zq)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class RefSpatialAttn(RefAttn):
    def __init__(self, c: int):
        super().__init__(c, 32)
        self.norm = RefSpatialNorm(c)

    def forward(self, x, zq):
        b, c, h, w = x.shape
        n = self.norm(x, zq)
        q = self.q(n).reshape(b, c, h * w).permute(0, 2, 1)
        attn = torch.softmax(torch.bmm(q, self.k(n).reshape(b, c, h * w)) * c**-0.5, dim=2)
        return x + self.proj_out(torch.bmm(self.v(n).reshape(b, c, h * w), attn.permute(0, 2, 1)).reshape(b, c, h, w))


class RefMoVQ(nn.Module):
    """The official MOVQ's modules under its names: encoder.down.{i}.block/attn/downsample, encoder.mid.block_1 /
    attn_1 / block_2, quantize.embedding, quant_conv, post_quant_conv, decoder.up.{i}.block/attn/upsample (level
    0 full size), attention at the lowest level (attn_resolutions [32] at resolution 256 for 4 levels)."""

    def __init__(self):
        super().__init__()
        last = len(MULT) - 1
        enc = nn.Module()
        enc.conv_in, enc.down, cin = nn.Conv2d(3, CH, 3, padding=1), nn.ModuleList(), CH
        for i, m in enumerate(MULT):
            level = nn.Module()
            level.block = nn.ModuleList([RefRes(cin if j == 0 else CH * m, CH * m, 32) for j in range(N_RES)])
            level.attn = nn.ModuleList([RefAttn(CH * m, 32) for _ in range(N_RES)] if i == last else [])
            if i != last:
                level.downsample = RefDown(CH * m)
            enc.down.append(level)
            cin = CH * m
        enc.mid = nn.Module()
        enc.mid.block_1, enc.mid.attn_1, enc.mid.block_2 = RefRes(cin, cin, 32), RefAttn(cin, 32), RefRes(cin, cin, 32)
        enc.norm_out, enc.conv_out = gn(cin, 32), nn.Conv2d(cin, Z, 3, padding=1)
        self.encoder = enc
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(CODES, DIM)
        self.quant_conv, self.post_quant_conv = nn.Conv2d(Z, DIM, 1), nn.Conv2d(DIM, Z, 1)
        dec = nn.Module()
        dec.conv_in = nn.Conv2d(Z, cin, 3, padding=1)
        dec.mid = nn.Module()
        dec.mid.block_1, dec.mid.attn_1 = RefSpatialRes(cin, cin), RefSpatialAttn(cin)
        dec.mid.block_2 = RefSpatialRes(cin, cin)
        ups = [nn.Module() for _ in MULT]
        for i in reversed(range(len(MULT))):
            out = CH * MULT[i]
            ups[i].block = nn.ModuleList([RefSpatialRes(cin if j == 0 else out, out) for j in range(N_RES + 1)])
            ups[i].attn = nn.ModuleList([RefSpatialAttn(out) for _ in range(N_RES + 1)] if i == last else [])
            if i != 0:
                ups[i].upsample = RefUp(out)
            cin = out
        dec.up = nn.ModuleList(ups)
        dec.norm_out, dec.conv_out = RefSpatialNorm(cin), nn.Conv2d(cin, 3, 3, padding=1)
        self.decoder = dec

    def encode_ids(self, x):
        e = self.encoder
        h = e.conv_in(x)
        for level in e.down:
            for j, block in enumerate(level.block):
                h = block(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = e.mid.block_2(e.mid.attn_1(e.mid.block_1(h)))
        z = self.quant_conv(e.conv_out(swish(e.norm_out(h))))  # [B, C, h, w]
        b, c, hh, ww = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, c)
        ids = ((flat[:, None] - self.quantize.embedding.weight[None]) ** 2).sum(-1).argmin(-1)
        return ids.reshape(b, hh, ww)

    def decode_code(self, ids):
        zq = self.quantize.embedding(ids).permute(0, 3, 1, 2)  # [B, C, h, w]
        d = self.decoder
        h = d.conv_in(self.post_quant_conv(zq))
        h = d.mid.block_2(d.mid.attn_1(d.mid.block_1(h, zq), zq), zq)
        for i in reversed(range(len(d.up))):
            for j, block in enumerate(d.up[i].block):
                h = block(h, zq)
                if len(d.up[i].attn):
                    h = d.up[i].attn[j](h, zq)
            if i != 0:
                h = d.up[i].upsample(h)
        return d.conv_out(swish(d.norm_out(h, zq)))


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    torch.manual_seed(0)
    ref = RefMoVQ().eval()
    with torch.no_grad():  # off the default affines and biases, so a swapped key would show
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("movqgan") / "movqgan_tiny.ckpt"
    torch.save({**ref.state_dict(), "loss.discriminator.main.0.weight": torch.zeros(2)}, path)
    return ref, path


def test_the_converted_model_encodes_and_decodes_as_the_reference(official):
    ref, path = official
    model = load_movqgan(path)
    assert (model.config.ch, tuple(model.config.ch_mult), model.config.codebook_size) == (CH, MULT, CODES)
    assert model.config.level_attention and model.downsample_factor == 2
    images = torch.rand(2, 3, 16, 12, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        ids = ref.encode_ids(images)
        assert torch.equal(model.encode_ids(images), ids)
        torch.testing.assert_close(model.decode_code(ids), ref.decode_code(ids), rtol=1e-4, atol=1e-5)
        missing = ids.clone()
        missing[0, 0, 0] = -1
        assert not torch.allclose(model.decode_code(missing, fill_missing=True)[0], model.decode_code(ids)[0])


def test_save_round_trip_and_refusals(official, tmp_path):
    _, path = official
    model = load_movqgan(path)
    model.save_pretrained(tmp_path / "m")
    again = MoVQGAN.from_pretrained(tmp_path / "m")
    ids = torch.randint(0, CODES, (1, 4, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(again.decode_code(ids), model.decode_code(ids), rtol=0, atol=0)
    torch.save({"encoder.conv_in.weight": torch.zeros(1)}, tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointError, match="not a MoVQGAN checkpoint"):
        load_movqgan(tmp_path / "bad.ckpt")


def official_repo() -> Path | None:
    found = os.environ.get("MMSPEC_LUMINA_MGPT2_REPO")
    return Path(found) if found and (Path(found) / "movqgan").is_dir() else None


@pytest.mark.skipif(official_repo() is None, reason="set MMSPEC_LUMINA_MGPT2_REPO to an extracted Alpha-VLLM/"
                                                    "Lumina-mGPT-2.0 `lumina_mgpt` folder to run its own modules")
def test_the_official_modules_decode_the_same(official):
    def module(name: str):  # the file alone: the package's __init__ imports pytorch_lightning
        path = official_repo() / "movqgan" / "modules" / "vqvae" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"official_movqgan_{name}", path)
        found = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(found)
        return found

    MOVQDecoder, Encoder = module("movq_modules").MOVQDecoder, module("vqvae_blocks").Encoder
    ref, path = official
    model = load_movqgan(path)
    ddconfig = dict(double_z=False, z_channels=Z, resolution=32 * 2 ** (len(MULT) - 1), in_channels=3, out_ch=3,
                    ch=CH, ch_mult=list(MULT), num_res_blocks=N_RES, attn_resolutions=[32], dropout=0.0)
    encoder, decoder = Encoder(**ddconfig).eval(), MOVQDecoder(zq_ch=DIM, **ddconfig).eval()
    sd = ref.state_dict()
    encoder.load_state_dict({k[len("encoder."):]: v for k, v in sd.items() if k.startswith("encoder.")})
    decoder.load_state_dict({k[len("decoder."):]: v for k, v in sd.items() if k.startswith("decoder.")})
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        z = ref.quant_conv(encoder(images))
        torch.testing.assert_close(model.quant_conv(model.encoder(images)), z, rtol=1e-4, atol=1e-5)
        ids = model.encode_ids(images)
        zq = ref.quantize.embedding(ids).permute(0, 3, 1, 2)
        torch.testing.assert_close(model.decode_code(ids), decoder(ref.post_quant_conv(zq), zq), rtol=1e-4,
                                   atol=1e-5)
