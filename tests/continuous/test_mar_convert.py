"""Official MAR checkpoints: synthetic files with the official layouts convert into this project's models.

- `checkpoint-last.pth` ({'model', 'model_ema', 'optimizer', 'epoch', 'scaler', 'args': argparse.Namespace}):
  the EMA weights load by default, 'model' on request, the converted MAR computes what the source computes, the
  official sizes and heads are inferred, foreign objects are refused, wrong files give errors naming the keys.
- `kl16.ckpt` ({'model': LDM-layout state dict} + training-only `loss.*`): the file's keys are exactly the LDM
  module tree (enumerated here from its structure), the converted diffusers AutoencoderKL encodes and decodes like
  the source, its attention equals LDM's AttnBlock formula, wrong shapes are reported.
- `mmspec convert mar` writes MAR and CSpD pipeline folders that load and generate.
"""

import argparse
import re

import pytest
import torch
import torch.nn.functional as F
from accelerate import init_empty_weights
from diffusers import AutoencoderKL

from continuous.mar.convert import infer_mar_config, load_mar_checkpoint
from continuous.mar.convert_vae import infer_kl_config, ldm_vae_rules, load_kl16_vae, rename_ldm_vae
from continuous.mar.model import MARModel
from continuous.mar.vae import KL16_CONFIG
from mmspec.checkpoints import unused_rename_rules
from mmspec.errors import CheckpointError, InputError

TINY_MAR = dict(img_size=16, vae_stride=4, patch_size=1, vae_embed_dim=4, embed_dim=32, num_heads=4, encoder_depth=2,
                decoder_depth=2, num_classes=10, buffer_size=4, diffloss_d=2, diffloss_w=32)


class TrainState:
    """Stands for any object in a checkpoint that is not on the safe-loading allow-list."""


def official_args(cfg: dict) -> argparse.Namespace:
    """The training arguments the official main_mar.py stores under 'args' (a subset, official names)."""
    return argparse.Namespace(model="mar_tiny", img_size=cfg["img_size"], vae_stride=cfg["vae_stride"],
                              patch_size=cfg["patch_size"], vae_embed_dim=cfg["vae_embed_dim"],
                              buffer_size=cfg["buffer_size"], class_num=cfg["num_classes"],
                              diffloss_d=cfg["diffloss_d"], diffloss_w=cfg["diffloss_w"], num_sampling_steps="100",
                              diffusion_batch_mul=4, label_drop_prob=0.1, mask_ratio_min=0.7, attn_dropout=0.1,
                              proj_dropout=0.1, blr=1e-4, ema_rate=0.9999, output_dir="./output_dir")


def mar_file(path, seed=0, extra=None, **config):
    """A tiny MAR saved as the official trainer saves it; returns (source model, 'model' sd, 'model_ema' sd)."""
    torch.manual_seed(seed)
    cfg = {**TINY_MAR, **config}
    source = MARModel(**cfg).eval()
    raw = {k: v.detach().clone() for k, v in source.state_dict().items()}
    ema = {k: v + 0.02 * torch.randn_like(v) for k, v in raw.items()}  # every tensor differs, zero-init ones too
    checkpoint = {"model": raw, "model_ema": ema, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]},
                  "epoch": 399, "scaler": {"scale": 65536.0, "_growth_tracker": 0}, "args": official_args(cfg)}
    checkpoint.update(extra or {})
    torch.save(checkpoint, path)
    return source, raw, ema


def assert_weights(model, sd):
    got = model.state_dict()
    assert set(got) == set(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)


# ------------------------------------------------------------------------------------------------- MAR
@pytest.mark.parametrize("config", [{}, {"decoder_embed_dim": 24, "decoder_num_heads": 3}])
def test_ema_weights_by_default_model_weights_on_request(tmp_path, config):
    path = tmp_path / "checkpoint-last.pth"
    _, raw, ema = mar_file(path, **config)
    heads = {"num_heads": 4, **({"decoder_num_heads": 3} if config else {})}
    converted = load_mar_checkpoint(path, **heads)
    assert not converted.training
    assert_weights(converted, ema)
    assert_weights(load_mar_checkpoint(path, weights="model", **heads), raw)
    for name, value in {**TINY_MAR, **config, "num_sampling_steps": 100, "diffusion_batch_mul": 4}.items():
        assert converted.config[name] == value, name
    with pytest.raises(InputError, match="num_heads="):  # width 32 is no official size, args.model no official name
        load_mar_checkpoint(path)


def test_converted_mar_computes_what_the_source_computes(tmp_path):
    path = tmp_path / "checkpoint-last.pth"
    source, _, ema = mar_file(path)
    source.load_state_dict(ema)
    converted = load_mar_checkpoint(path, num_heads=4)
    tokens = torch.randn(3, 16, 4)
    known = torch.rand(3, 16) < torch.tensor([[0.0], [0.3], [0.8]])  # ragged rows
    labels = torch.tensor([0, 9, 10])  # 10: the null class (fake_latent)
    with torch.no_grad():
        z = converted.predict(tokens, known, converted.condition(labels))
        torch.testing.assert_close(z, source.predict(tokens, known, source.condition(labels)), rtol=0, atol=0)
        x, t = torch.randn(5, 4), torch.tensor([0, 10, 500, 900, 999])
        torch.testing.assert_close(converted.diffloss.net(x, t, z[0, :5]), source.diffloss.net(x, t, z[0, :5]),
                                   rtol=0, atol=0)


def test_official_sizes_and_heads_are_inferred():
    with init_empty_weights():  # MAR-B's shapes without allocating its weights
        base = MARModel(embed_dim=768, num_heads=12, encoder_depth=12, decoder_depth=12, diffloss_d=6,
                        diffloss_w=1024)
    sd = base.state_dict()
    args = argparse.Namespace(model="mar_base", img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16,
                              buffer_size=64, class_num=1000, diffloss_d=6, diffloss_w=1024, num_sampling_steps="100")
    expected = dict(embed_dim=768, num_heads=12, encoder_depth=12, decoder_depth=12, decoder_embed_dim=768,
                    mlp_ratio=4.0, num_classes=1000, buffer_size=64, diffloss_d=6, diffloss_w=1024, img_size=256,
                    vae_stride=16, patch_size=1, vae_embed_dim=16, num_sampling_steps=100,
                    default_guidance_scale=2.9)  # the paper's evaluation cfg of MAR-B
    for with_args in (args, None):  # without args: the official stride/patch/channels and the heads of width 768
        cfg = infer_mar_config(sd, with_args)
        assert {k: cfg.get(k) for k in expected} == {**expected, **({} if with_args else {"num_sampling_steps": None})}
    assert infer_mar_config(sd, args, num_heads=8)["num_heads"] == 8  # the caller wins
    assert infer_mar_config(sd, args, default_guidance_scale=4.0)["default_guidance_scale"] == 4.0
    huge = argparse.Namespace(**{**vars(args), "model": "mar_huge"})  # the name wins over the width
    assert infer_mar_config(sd, huge, num_heads=12)["default_guidance_scale"] == 3.2
    with pytest.raises(InputError, match="token grid"):
        infer_mar_config(sd, args, img_size=512)
    with pytest.raises(InputError, match="unknown MARModel argument"):
        infer_mar_config(sd, args, depth=3)
    with pytest.raises(CheckpointError, match="class_num"):
        infer_mar_config(sd, argparse.Namespace(class_num=10))


def test_objects_off_the_allow_list_are_refused_unless_allow_pickle(tmp_path):
    path = tmp_path / "checkpoint-last.pth"
    _, _, ema = mar_file(path, extra={"train_state": TrainState()})
    with pytest.raises(CheckpointError) as err:
        load_mar_checkpoint(path, num_heads=4)
    assert "TrainState" in str(err.value) and "not allow-listed" in str(err.value)
    assert "allow_pickle=True" in str(err.value)
    assert_weights(load_mar_checkpoint(path, allow_pickle=True, num_heads=4), ema)


def test_wrong_files_are_clear_errors(tmp_path):
    path = tmp_path / "checkpoint-last.pth"
    mar_file(path)
    checkpoint = torch.load(path, weights_only=False)
    ema = checkpoint["model_ema"]
    del ema["decoder_norm.weight"]
    ema["encoder_blocks.1.mlp.fc2.bias"] = torch.zeros(33)
    ema["extra_head.weight"] = torch.zeros(2)
    torch.save(checkpoint, tmp_path / "damaged.pth")
    with pytest.raises(CheckpointError) as err:
        load_mar_checkpoint(tmp_path / "damaged.pth", num_heads=4)
    message = str(err.value)
    for key in ("decoder_norm.weight", "encoder_blocks.1.mlp.fc2.bias", "extra_head.weight", "[33]"):
        assert key in message, key
    load_mar_checkpoint(tmp_path / "damaged.pth", weights="model", num_heads=4)  # 'model' is intact

    checkpoint["model_ema"] = None  # trained without EMA
    torch.save(checkpoint, tmp_path / "no_ema.pth")
    with pytest.raises(CheckpointError, match="weights='model'"):
        load_mar_checkpoint(tmp_path / "no_ema.pth", num_heads=4)
    torch.save({"model": {"tok_embeddings.weight": torch.zeros(2, 2)}}, tmp_path / "gpt.pth")
    with pytest.raises(CheckpointError, match="not a MAR checkpoint"):
        load_mar_checkpoint(tmp_path / "gpt.pth", weights="model")
    with pytest.raises(InputError, match="weights"):
        load_mar_checkpoint(path, weights="best")


# ------------------------------------------------------------------------------------------------- KL VAE
TINY_KL = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16),
               down_block_types=("DownEncoderBlock2D",) * 2 + ("AttnDownEncoderBlock2D",),
               up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=2, norm_num_groups=4, sample_size=16,
               scaling_factor=0.2325)
_UP_PARTS = {"resnets": "block", "attentions": "attn", "upsamplers.0": "upsample"}
_ATTN_PARTS = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def to_ldm(sd: dict, n_levels: int) -> dict:
    """diffusers AutoencoderKL keys -> the LDM layout of kl16.ckpt (written independently of the converter),
    attention linear weights back to 1x1 convs, plus training-only `loss.*` entries."""
    out = {}
    for key, value in sd.items():
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", key)
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.attentions\.", r"encoder.down.\1.attn.", k)
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.(resnets|attentions|upsamplers\.0)\.",
                   lambda m: f"decoder.up.{n_levels - 1 - int(m.group(1))}.{_UP_PARTS[m.group(2)]}.", k)
        k = k.replace(".mid_block.resnets.0.", ".mid.block_1.").replace(".mid_block.resnets.1.", ".mid.block_2.")
        k = k.replace(".mid_block.attentions.0.", ".mid.attn_1.")
        k = k.replace(".conv_shortcut.", ".nin_shortcut.").replace(".conv_norm_out.", ".norm_out.")
        m = re.search(r"\.(attn\.\d+|attn_1)\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(weight|bias)$", k)
        if m:
            k = f"{k[:m.start()]}.{m.group(1)}.{_ATTN_PARTS[m.group(2)]}.{m.group(3)}"
            if m.group(3) == "weight" and m.group(2) != "group_norm":
                value = value[:, :, None, None]
        out[k] = value.clone()
    out["loss.logvar"] = torch.zeros(())
    out["loss.discriminator.main.0.weight"] = torch.randn(8, 3, 4, 4)
    return out


def official_ldm_keys(widths: tuple, blocks: int, attn_levels: set, decoder_attn_levels: set = frozenset()) -> set:
    """The state-dict keys of the LDM Encoder/Decoder + quant convs (kl16's module tree) for these sizes, with
    attention after every block of the given resolution levels (0 = full resolution)."""
    keys: set = set()

    def layer(name):
        keys.update({f"{name}.weight", f"{name}.bias"})

    def resnet(prefix, c_in, c_out):
        for part in ("norm1", "conv1", "norm2", "conv2") + (("nin_shortcut",) if c_in != c_out else ()):
            layer(f"{prefix}.{part}")

    def attention(prefix):
        for part in ("norm", "q", "k", "v", "proj_out"):
            layer(f"{prefix}.{part}")

    n, c = len(widths), widths[0]
    for part in ("encoder", "decoder"):
        layer(f"{part}.conv_in"), layer(f"{part}.norm_out"), layer(f"{part}.conv_out")
        resnet(f"{part}.mid.block_1", widths[-1], widths[-1]), attention(f"{part}.mid.attn_1")
        resnet(f"{part}.mid.block_2", widths[-1], widths[-1])
    for i, width in enumerate(widths):
        for j in range(blocks):
            resnet(f"encoder.down.{i}.block.{j}", c, width)
            c = width
            if i in attn_levels:
                attention(f"encoder.down.{i}.attn.{j}")
        if i != n - 1:
            layer(f"encoder.down.{i}.downsample.conv")
    for i in reversed(range(n)):
        for j in range(blocks + 1):
            resnet(f"decoder.up.{i}.block.{j}", c, widths[i])
            c = widths[i]
            if i in decoder_attn_levels:
                attention(f"decoder.up.{i}.attn.{j}")
        if i != 0:
            layer(f"decoder.up.{i}.upsample.conv")
    layer("quant_conv"), layer("post_quant_conv")
    return keys


# kl16's structure; the same with attention in the decoder's lowest-resolution level (LDM level 2 = diffusers
# up_blocks.0), which kl16 lacks but the LDM decoder supports
VARIANTS = {"kl16": {}, "decoder-attention": {"up_block_types": ("AttnUpDecoderBlock2D",) + ("UpDecoderBlock2D",) * 2}}


@pytest.fixture(params=list(VARIANTS))
def kl_source_and_file(tmp_path, request):
    torch.manual_seed(0)
    source = AutoencoderKL(**{**TINY_KL, **VARIANTS[request.param]}).eval()
    ldm = to_ldm(dict(source.state_dict()), 3)
    path = tmp_path / "kl16.ckpt"
    torch.save({"model": ldm}, path)
    return source, ldm, path


def test_the_file_has_the_ldm_module_tree(kl_source_and_file):
    source, ldm, _ = kl_source_and_file
    decoder_attn = {2} if source.config.up_block_types[0] == "AttnUpDecoderBlock2D" else set()
    assert {k for k in ldm if not k.startswith("loss.")} == official_ldm_keys((8, 8, 16), 2, {2}, decoder_attn)
    assert ldm["encoder.down.2.attn.1.q.weight"].shape == (16, 16, 1, 1)
    assert ldm["decoder.up.1.block.0.nin_shortcut.weight"].shape == (8, 16, 1, 1)  # level 1: 16 -> 8 channels
    assert ldm["encoder.conv_out.weight"].shape[0] == 8 and ldm["quant_conv.weight"].shape == (8, 8, 1, 1)
    rules = ldm_vae_rules(3)  # every rule is used, the decoder-attention one only where there is some
    assert unused_rename_rules(ldm, rules) == ([] if decoder_attn else [rules[4]])
    cfg = infer_kl_config(ldm)
    assert {k: cfg[k] for k in ("block_out_channels", "layers_per_block", "latent_channels", "down_block_types",
                                "up_block_types", "mid_block_add_attention")} == {
        **{k: source.config[k] for k in ("block_out_channels", "layers_per_block", "latent_channels",
                                         "down_block_types", "up_block_types")}, "mid_block_add_attention": True}
    assert cfg["norm_num_groups"] == 32 and cfg["scaling_factor"] == 0.2325  # not in the weights: kl16's


def test_kl16_config_is_the_official_kl16_tree():
    """At full size (shapes only, on the meta device): the official kl16 Encoder/Decoder (ch 128, ch_mult
    (1, 1, 2, 2, 4), 2 res blocks, attention at 16 px = level 4 of the encoder) is `KL16_CONFIG`, key for key and
    shape for shape after the renaming."""
    with init_empty_weights():
        kl16 = AutoencoderKL(**KL16_CONFIG)
    target = kl16.state_dict()
    ldm = to_ldm(dict(target), 5)
    assert {k for k in ldm if not k.startswith("loss.")} == official_ldm_keys((128, 128, 256, 256, 512), 2, {4})
    cfg = infer_kl_config(ldm)
    assert {k: cfg[k] for k in KL16_CONFIG} == {k: KL16_CONFIG[k] for k in KL16_CONFIG}
    renamed = rename_ldm_vae({k: v for k, v in ldm.items() if not k.startswith("loss.")})
    assert {k: tuple(v.shape) for k, v in renamed.items()} == {k: tuple(v.shape) for k, v in target.items()}


def test_converted_vae_encodes_and_decodes_like_the_source(kl_source_and_file):
    source, _, path = kl_source_and_file
    vae = load_kl16_vae(path, norm_num_groups=4, sample_size=16)  # `loss.*` entries are ignored
    assert not vae.training and vae.config.block_out_channels == (8, 8, 16)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        got, want = vae.encode(images).latent_dist, source.encode(images).latent_dist
        torch.testing.assert_close(got.mean, want.mean)
        torch.testing.assert_close(got.logvar, want.logvar)
        torch.testing.assert_close(vae.decode(want.mean).sample, source.decode(want.mean).sample)


def test_converted_attention_is_ldm_attnblock(kl_source_and_file):
    _, ldm, path = kl_source_and_file
    vae = load_kl16_vae(path, norm_num_groups=4)
    x = torch.randn(2, 16, 3, 3)
    p = "encoder.mid.attn_1."
    h = F.group_norm(x, 4, ldm[p + "norm.weight"], ldm[p + "norm.bias"], eps=1e-6)
    q, k, v = (F.conv2d(h, ldm[p + f"{n}.weight"], ldm[p + f"{n}.bias"]).flatten(2) for n in "qkv")  # [B, C, HW]
    w = torch.softmax(torch.bmm(q.transpose(1, 2), k) * 16 ** -0.5, dim=2)  # [B, HW(q), HW(k)]
    out = torch.bmm(v, w.transpose(1, 2)).view(2, 16, 3, 3)
    ref = x + F.conv2d(out, ldm[p + "proj_out.weight"], ldm[p + "proj_out.bias"])
    with torch.no_grad():
        torch.testing.assert_close(vae.encoder.mid_block.attentions[0](x), ref, rtol=1e-5, atol=1e-5)


def test_wrong_vae_files_are_clear_errors(kl_source_and_file, tmp_path):
    _, ldm, _ = kl_source_and_file
    bad = dict(ldm)
    bad["decoder.up.0.block.1.conv1.weight"] = torch.zeros(8, 8, 1, 1)
    del bad["encoder.down.2.attn.0.k.bias"]
    bad["encoder.extra.weight"] = torch.zeros(1)
    torch.save({"model": bad}, tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointError) as err:
        load_kl16_vae(tmp_path / "bad.ckpt", norm_num_groups=4)
    message = str(err.value)
    for text in ("decoder.up_blocks.2.resnets.1.conv1.weight: checkpoint shape [8, 8, 1, 1] vs model shape "
                 "[8, 8, 3, 3]", "encoder.down_blocks.2.attentions.0.to_k.bias", "encoder.extra.weight", "bad.ckpt"):
        assert text in message, text
    assert "loss." not in message
    torch.save({"model": {"tok_embeddings.weight": torch.zeros(2, 2)}}, tmp_path / "gpt.ckpt")
    with pytest.raises(CheckpointError, match="not an LDM-layout KL VAE"):
        load_kl16_vae(tmp_path / "gpt.ckpt")


# ------------------------------------------------------------------------------------------------- CLI
def test_mmspec_convert_mar_writes_mar_and_cspd_pipelines(tmp_path):
    from continuous.mar.cspd import CSpDPipeline
    from continuous.mar.pipeline import MARPipeline
    from mmspec.cli import main

    _, _, target_ema = mar_file(tmp_path / "target.pth", seed=1)
    _, _, draft_ema = mar_file(tmp_path / "draft.pth", seed=2, embed_dim=16, num_heads=2, encoder_depth=1,
                               decoder_depth=1, diffloss_d=1, diffloss_w=16)
    torch.manual_seed(3)  # kl16's structure at 4x downsampling, widths multiple of its 32 norm groups
    vae = AutoencoderKL(**{**TINY_KL, "block_out_channels": (32, 32, 64), "norm_num_groups": 32,
                           "layers_per_block": 1})
    torch.save({"model": to_ldm(dict(vae.state_dict()), 3)}, tmp_path / "kl16.ckpt")
    args = ["convert", "mar", "--target", str(tmp_path / "target.pth"), "--vae", str(tmp_path / "kl16.ckpt"),
            "--num-heads", "4"]
    assert main([*args, "--out", str(tmp_path / "mar")]) == 0
    assert main([*args, "--draft", str(tmp_path / "draft.pth"), "--draft-num-heads", "2",
                 "--out", str(tmp_path / "cspd")]) == 0

    mar = MARPipeline.from_pretrained(tmp_path / "mar")
    assert_weights(mar.transformer, target_ema)
    assert mar.vae.config.sample_size == 16 and mar.vae.config.scaling_factor == 0.2325
    mar.set_progress_bar_config(disable=True)
    out = mar(class_labels=[1, 3], num_iter=2, num_sampling_steps=2, output_type="latent",
              generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (2, 16, 4) and torch.isfinite(out.images).all()

    cspd = CSpDPipeline.from_pretrained(tmp_path / "cspd")
    assert_weights(cspd.draft, draft_ema)
    cspd.set_progress_bar_config(disable=True)
    out = cspd(class_labels=[2], gamma=3, num_sampling_steps=2, output_type="latent",
               generator=torch.Generator().manual_seed(0), budget="fixed")
    assert out.images.shape == (1, 16, 4) and out.stats.num_draft_forwards > 0

    wrong = ["convert", "mar", "--target", str(tmp_path / "kl16.ckpt"), "--vae", str(tmp_path / "kl16.ckpt"),
             "--out", str(tmp_path / "bad")]
    assert main(wrong) != 0 and not (tmp_path / "bad").exists()
