"""Load the official MAR KL-16 VAE (`kl16.ckpt`, `{'model': state dict}` in the LDM layout) into a diffusers
`AutoencoderKL`.

The LDM module tree and diffusers' `AutoencoderKL` hold the same layers under other names (LDM -> diffusers):

    encoder.down.{i}.block.{j}.*            -> encoder.down_blocks.{i}.resnets.{j}.*
    encoder.down.{i}.attn.{j}.*             -> encoder.down_blocks.{i}.attentions.{j}.*
    encoder.down.{i}.downsample.conv        -> encoder.down_blocks.{i}.downsamplers.0.conv
    decoder.up.{i}.block.{j} / attn.{j}     -> decoder.up_blocks.{n-1-i}.resnets.{j} / attentions.{j}  (LDM's
                                               `up[i]` is resolution level i; diffusers lists the decoder's
                                               blocks from the lowest resolution)
    decoder.up.{i}.upsample.conv            -> decoder.up_blocks.{n-1-i}.upsamplers.0.conv
    {encoder,decoder}.mid.block_1 / attn_1 / block_2 -> .mid_block.resnets.0 / attentions.0 / resnets.1
    {encoder,decoder}.norm_out              -> .conv_norm_out
    *.nin_shortcut                          -> *.conv_shortcut
    attention norm / q / k / v / proj_out   -> group_norm / to_q / to_k / to_v / to_out.0, the 1x1 conv weights
                                               [C, C, 1, 1] becoming linear weights [C, C]

`conv_in`, `conv_out`, resnet `norm1/conv1/norm2/conv2`, `quant_conv` and `post_quant_conv` keep their names.
Training-only entries (`loss.*`: LPIPS and discriminator) are ignored. The attention math is the same: LDM's
`AttnBlock` is single-head attention scaled by C^-0.5 with a residual, which is diffusers' `Attention` with one
head of width C.

Config inference (every keyword the caller passes wins; the rest is `KL16_CONFIG`): `block_out_channels` from each
encoder level's first conv, `layers_per_block` from the encoder's blocks per level, `latent_channels` from
`post_quant_conv`, in/out channels from `conv_in` / `conv_out`, the attention levels (`AttnDownEncoderBlock2D` /
`AttnUpDecoderBlock2D`) from the `attn` entries, and `mid_block_add_attention` from `mid.attn_1`.
`norm_num_groups` (32), `sample_size` (256) and `scaling_factor` (0.2325) are not in the weights.

    vae = load_kl16_vae("pretrained_models/vae/kl16.ckpt")      # eval mode
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKL
from torch import nn

from continuous.mar.vae import KL16_CONFIG
from mmspec.checkpoints import RenameRule, load_into, load_state_dict, rename_keys
from mmspec.errors import CheckpointError, check_float_dtype

IGNORED_KEYS = (r"^loss\.",)
_ATTENTION_WEIGHT = re.compile(r"\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$")


def ldm_vae_rules(num_levels: int) -> list[RenameRule]:
    """The LDM -> diffusers renaming rules (see the module docstring) for a VAE of `num_levels` resolutions,
    applied in order."""

    def up(template: str):
        return lambda m: template.format(num_levels - 1 - int(m.group(1)), *m.groups()[1:])

    return [
        (r"^encoder\.down\.(\d+)\.block\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
        (r"^encoder\.down\.(\d+)\.attn\.(\d+)\.", r"encoder.down_blocks.\1.attentions.\2."),
        (r"^encoder\.down\.(\d+)\.downsample\.conv\.", r"encoder.down_blocks.\1.downsamplers.0.conv."),
        (r"^decoder\.up\.(\d+)\.block\.(\d+)\.", up("decoder.up_blocks.{}.resnets.{}.")),
        (r"^decoder\.up\.(\d+)\.attn\.(\d+)\.", up("decoder.up_blocks.{}.attentions.{}.")),
        (r"^decoder\.up\.(\d+)\.upsample\.conv\.", up("decoder.up_blocks.{}.upsamplers.0.conv.")),
        (r"^(encoder|decoder)\.mid\.block_1\.", r"\1.mid_block.resnets.0."),
        (r"^(encoder|decoder)\.mid\.attn_1\.", r"\1.mid_block.attentions.0."),
        (r"^(encoder|decoder)\.mid\.block_2\.", r"\1.mid_block.resnets.1."),
        (r"^(encoder|decoder)\.norm_out\.", r"\1.conv_norm_out."),
        (r"\.nin_shortcut\.", ".conv_shortcut."),
        (r"(\.attentions\.\d+)\.norm\.", r"\1.group_norm."),
        (r"(\.attentions\.\d+)\.([qkv])\.", r"\1.to_\2."),
        (r"(\.attentions\.\d+)\.proj_out\.", r"\1.to_out.0."),
    ]


def _levels(sd: Mapping[str, Any], prefix: str) -> list[int]:
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return sorted({int(m.group(1)) for k in sd if (m := pattern.match(k))})


def _check_ldm_vae(sd: Mapping[str, torch.Tensor]) -> int:
    """The number of resolution levels of an LDM-layout VAE state dict (a clear error if it is not one)."""
    needed = ("encoder.conv_in.weight", "decoder.conv_out.weight", "post_quant_conv.weight")
    absent = [k for k in needed if k not in sd]
    levels = _levels(sd, "encoder.down")
    if absent or not levels:
        raise CheckpointError(f"not an LDM-layout KL VAE checkpoint (kl16.ckpt): {', '.join(absent) or 'encoder.down'}"
                              f" missing (found e.g. {', '.join(list(sd)[:5])}).")
    up = _levels(sd, "decoder.up")
    if up and len(up) != len(levels):
        raise CheckpointError(f"the VAE's encoder has {len(levels)} levels but its decoder {len(up)}; the file is "
                              "inconsistent.")
    return len(levels)


def rename_ldm_vae(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LDM VAE keys -> diffusers `AutoencoderKL` keys, with the attention 1x1 conv weights made linear."""
    out = rename_keys(sd, ldm_vae_rules(_check_ldm_vae(sd)))
    for key, value in out.items():
        if _ATTENTION_WEIGHT.search(key) and value.dim() == 4 and tuple(value.shape[2:]) == (1, 1):
            out[key] = value[:, :, 0, 0]
    return out


def infer_kl_config(sd: Mapping[str, torch.Tensor], **known: Any) -> dict[str, Any]:
    """`AutoencoderKL` arguments from an LDM-layout state dict (see the module docstring); `known` wins."""
    n = _check_ldm_vae(sd)
    try:
        widths = tuple(int(sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) for i in range(n))
    except KeyError as err:
        raise CheckpointError(f"not an LDM-layout KL VAE checkpoint: {err.args[0]!r} is missing.") from None
    decoder_attn = [f"decoder.up.{n - 1 - k}.attn.0.q.weight" in sd for k in range(n)]  # diffusers' order
    cfg: dict[str, Any] = dict(KL16_CONFIG)
    cfg.update(
        in_channels=int(sd["encoder.conv_in.weight"].shape[1]),
        out_channels=int(sd["decoder.conv_out.weight"].shape[0]),
        latent_channels=int(sd["post_quant_conv.weight"].shape[0]),
        block_out_channels=widths,
        layers_per_block=len(_levels(sd, "encoder.down.0.block")),
        down_block_types=tuple("AttnDownEncoderBlock2D" if f"encoder.down.{i}.attn.0.q.weight" in sd
                               else "DownEncoderBlock2D" for i in range(n)),
        up_block_types=tuple("AttnUpDecoderBlock2D" if a else "UpDecoderBlock2D" for a in decoder_attn),
        mid_block_add_attention="encoder.mid.attn_1.q.weight" in sd,
    )
    cfg.update(known)
    return cfg


def load_kl16_vae(path: str | os.PathLike[str], allow_pickle: bool = False, *, dtype: torch.dtype = torch.float32,
                  **config_overrides: Any) -> AutoencoderKL:
    """Build a diffusers `AutoencoderKL` from the official `kl16.ckpt` (or any LDM-layout KL VAE), in eval mode, in
    `dtype` on the CPU. config_overrides: `AutoencoderKL` arguments that win over the inferred ones (e.g.
    `norm_num_groups`, `sample_size`, `scaling_factor`)."""
    check_float_dtype(dtype)
    sd = load_state_dict(path, allow_pickle=allow_pickle, keys=("model", "state_dict"))
    cfg = infer_kl_config(sd, **config_overrides)
    with init_empty_weights():  # parameters on the meta device: no random initialisation
        vae = AutoencoderKL(**cfg)
    try:
        load_into(vae, rename_ldm_vae(sd), ignore_unexpected=IGNORED_KEYS, assign=True)
    except CheckpointError as err:
        raise CheckpointError(
            f"{path}: {err}\nThe keys above are diffusers AutoencoderKL names after the LDM renaming "
            "(continuous.mar.convert_vae: e.g. LDM decoder.up.{i}.block.{j} is decoder.up_blocks.{n-1-i}.resnets.{j}). "
            "The structure is inferred from the file; a VAE that differs from it needs AutoencoderKL overrides "
            "(e.g. down_block_types=).") from err
    left = [n for n, t in [*vae.named_parameters(), *vae.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"Checkpoint {path} left these tensors unloaded: {', '.join(left)}.")
    return nn.Module.to(vae, dtype=dtype).eval()
