"""The official VAR VQVAE layout (`vae_ch160v4096z32.pth`: LDM key names, fused attention qkv convs, decoder
levels indexed by resolution) converts into VARVQVAE: the official key names of a tiny config are what the file
holds, the fused attention equals the split one, and the converted VQVAE encodes and decodes like the source."""

import re

import pytest
import torch
import torch.nn.functional as F
from vq_reference import taming_names

from image_ar.var.convert_vqvae import infer_vqvae_config, load_var_vqvae
from image_ar.var.vqvae import VARVQVAE
from mmspec.errors import CheckpointError

CONFIG = dict(vocab_size=16, z_channels=4, ch=8, ch_mult=(1, 2), num_res_blocks=1, norm_num_groups=4,
              patch_nums=(1, 2, 4))


def to_official(sd: dict, n_levels: int) -> dict:
    """This project's keys -> the official LDM layout (independent inverse of the converter's renaming), q, k, v
    fused into VAR's qkv."""
    out = {}
    for k, value in taming_names(sd, n_levels).items():
        m = re.search(r"\.([qkv])\.(weight|bias)$", k)
        if m:
            fused = k[: m.start()] + f".qkv.{m.group(2)}"
            out.setdefault(fused, [None, None, None])["qkv".index(m.group(1))] = value
            continue
        out[k] = value
    official = {k: torch.cat(v, 0) if isinstance(v, list) else v for k, v in out.items()}
    official["quantize.ema_vocab_hit_SV"] = torch.zeros(3, 16)  # training statistics in the official file
    return official


@pytest.fixture
def source_and_file(tmp_path):
    torch.manual_seed(0)
    source = VARVQVAE(**CONFIG).eval()
    official = to_official(dict(source.state_dict()), len(CONFIG["ch_mult"]))
    path = tmp_path / "vae_tiny.pth"
    torch.save(official, path)
    return source, official, path


def test_the_file_has_the_official_key_names(source_and_file):
    _, official, _ = source_and_file
    for key in ("encoder.conv_in.weight", "encoder.down.0.block.0.conv1.weight",
                "encoder.down.0.downsample.conv.weight", "encoder.down.1.attn.0.qkv.weight",
                "encoder.mid.block_1.norm1.weight", "encoder.mid.attn_1.qkv.bias", "decoder.up.0.block.1.conv2.weight",
                "decoder.up.1.upsample.conv.weight", "decoder.up.1.attn.1.qkv.weight", "quant_conv.weight",
                "quantize.embedding.weight", "quantize.quant_resi.qresi_ls.3.weight"):
        assert key in official, key
    assert official["encoder.down.1.attn.0.qkv.weight"].shape == (48, 16, 1, 1)


def test_converted_vqvae_equals_the_source(source_and_file):
    source, _, path = source_and_file
    converted = load_var_vqvae(path, patch_nums=(1, 2, 4), norm_num_groups=4)
    images = torch.rand(2, 3, 8, 8) * 2 - 1
    pyramid = source.encode(images)
    assert all(torch.equal(a, b) for a, b in zip(converted.encode(images), pyramid))
    with torch.no_grad():
        torch.testing.assert_close(converted.decode(pyramid), source.decode(pyramid))


def test_split_attention_equals_the_official_fused_formula(source_and_file):
    source, official, path = source_and_file
    converted = load_var_vqvae(path, patch_nums=(1, 2, 4), norm_num_groups=4)
    block = converted.encoder.mid[1]
    x = torch.randn(2, 16, 2, 2)
    h = F.group_norm(x, 4, official["encoder.mid.attn_1.norm.weight"], official["encoder.mid.attn_1.norm.bias"], 1e-6)
    qkv = F.conv2d(h, official["encoder.mid.attn_1.qkv.weight"], official["encoder.mid.attn_1.qkv.bias"])
    q, k, v = qkv.reshape(2, 3, 16, 4).unbind(1)  # [B, C, HW] each
    w = torch.softmax(torch.bmm(q.transpose(1, 2), k) * 16**-0.5, dim=2)  # [B, HW(q), HW(k)]
    out = torch.bmm(v, w.transpose(1, 2)).view(2, 16, 2, 2)
    proj = (official["encoder.mid.attn_1.proj_out.weight"], official["encoder.mid.attn_1.proj_out.bias"])
    ref = x + F.conv2d(out, *proj)
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref, rtol=1e-5, atol=1e-5)


def test_config_inference_and_wrong_files(source_and_file, tmp_path):
    _, official, _ = source_and_file
    cfg = infer_vqvae_config(official)
    assert (cfg["vocab_size"], cfg["z_channels"], cfg["ch"], cfg["ch_mult"], cfg["num_res_blocks"],
            cfg["share_quant_resi"], cfg["quant_conv_ks"]) == (16, 4, 8, (1, 2), 1, 4, 3)
    other = tmp_path / "gpt.pth"
    torch.save({"tok_embeddings.weight": torch.zeros(2, 2)}, other)
    with pytest.raises(CheckpointError, match="not a VAR VQVAE"):
        load_var_vqvae(other)


def test_mmspec_convert_var_writes_var_and_code_pipelines(tmp_path):
    from image_ar.var import CoDePipeline, VARPipeline, VARTransformer
    from mmspec.cli import main

    torch.manual_seed(1)
    pns = (1, 2, 4)
    vae = VARVQVAE(vocab_size=16, z_channels=4, ch=32, ch_mult=(1, 2), num_res_blocks=1, patch_nums=pns)
    torch.save(to_official(dict(vae.state_dict()), 2), tmp_path / "vae.pth")
    for name, depth in (("var_d2.pth", 2), ("var_d1.pth", 1)):
        model = VARTransformer(vocab_size=16, cvae=4, num_classes=3, depth=depth, embed_dim=16, num_heads=2,
                               patch_nums=pns)
        torch.save(model.state_dict(), tmp_path / name)
    args = ["convert", "var", "--transformer", str(tmp_path / "var_d2.pth"), "--vqvae", str(tmp_path / "vae.pth"),
            "--patch-nums", "1,2,4"]
    assert main([*args, "--out", str(tmp_path / "var")]) == 0
    assert main([*args, "--small", str(tmp_path / "var_d1.pth"), "--out", str(tmp_path / "code")]) == 0
    var = VARPipeline.from_pretrained(tmp_path / "var")
    code = CoDePipeline.from_pretrained(tmp_path / "code")
    assert var.transformer.depth == 2 and code.refiner.depth == 1
    var.set_progress_bar_config(disable=True)
    images = var(class_labels=[1], generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert images.shape == (1, 3, 8, 8)
    assert main(["convert", "var", "--transformer", str(tmp_path / "vae.pth"), "--vqvae", str(tmp_path / "vae.pth"),
                 "--out", str(tmp_path / "bad")]) != 0
