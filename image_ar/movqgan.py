"""MoVQGAN (ai-forever/MoVQGAN), Lumina-mGPT 2.0's image tokenizer, as a diffusers model: `MoVQGAN(ModelMixin,
ConfigMixin)`, loaded from the official `movqgan_270M.ckpt` by `load_movqgan`.

    images [B, 3, H, W] in [-1, 1]
      -> encoder: taming's (`image_ar.conv_autoencoder.Encoder`; `attn_resolutions: [32]` at resolution 256 with
         ch_mult [1, 2, 2, 4] is attention after each block of the lowest level)        -> [B, z_channels, h, w]
      -> quant_conv (1x1) -> the legacy nearest-code quantizer (squared L2, unnormalised; 16384 codes of 4)
                                                                                          -> codes [B, h, w]
      -> lookup zq [B, 4, h, w] -> post_quant_conv (1x1) -> the MoVQ decoder (zq)         -> [B, 3, H, W]

h = H / 8. The MoVQ decoder is taming's decoder in which every GroupNorm is a spatial norm conditioned on the codes:
`SpatialNorm(f, zq) = GroupNorm(f) * conv_y(zq') + conv_b(zq')`, zq' the code vectors upsampled (nearest) to f's
size, conv_y / conv_b 1x1 (the official `add_conv=False`). Module names follow `image_ar.conv_autoencoder`'s, so
`rename_taming_keys` maps the official ones (`decoder.up.{i}.block.{j}.norm1.norm_layer.weight`, `...conv_y`, ...).
The official 270M model: ch 256, ch_mult [1, 2, 2, 4], 2 blocks a level (3 in the decoder), z 4.

Glossary: B images, C code width, h x w the code grid, f the decoder's feature map.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from image_ar.conv_autoencoder import Encoder, Upsample, rename_taming_keys, taming_config
from image_ar.llamagen.vq import VectorQuantizer
from mmspec.checkpoints import load_into, load_state_dict
from mmspec.checkpoints.keys import strip_wrapper_prefixes
from mmspec.errors import check, check_float_dtype

IGNORED_KEYS = (r"^loss\.", r"^ema_")  # a training checkpoint's loss (discriminator, LPIPS) and EMA copies


class SpatialNorm(nn.Module):
    """GroupNorm(f) * conv_y(zq') + conv_b(zq'), zq' = zq upsampled (nearest) to f's size."""

    def __init__(self, channels: int, zq_channels: int, groups: int) -> None:
        super().__init__()
        self.norm_layer = nn.GroupNorm(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)
        self.conv_y = nn.Conv2d(zq_channels, channels, kernel_size=1)
        self.conv_b = nn.Conv2d(zq_channels, channels, kernel_size=1)

    def forward(self, f: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:  # f [B, c, H', W'], zq [B, C, h, w]
        zq = F.interpolate(zq, size=f.shape[-2:], mode="nearest")
        return self.norm_layer(f) * self.conv_y(zq) + self.conv_b(zq)


class SpatialResnetBlock(nn.Module):
    """taming's ResnetBlock with spatial norms: norm1 -> swish -> conv1 -> norm2 -> swish -> conv2, + skip."""

    def __init__(self, cin: int, cout: int, zq_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = SpatialNorm(cin, zq_channels, groups)
        self.conv1 = nn.Conv2d(cin, cout, kernel_size=3, padding=1)
        self.norm2 = SpatialNorm(cout, zq_channels, groups)
        self.conv2 = nn.Conv2d(cout, cout, kernel_size=3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, kernel_size=1)

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x, zq))), zq)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class SpatialAttnBlock(nn.Module):
    """Single-head self-attention over the positions (1x1 q, k, v, proj_out), its input spatially normed."""

    def __init__(self, channels: int, zq_channels: int, groups: int) -> None:
        super().__init__()
        self.norm = SpatialNorm(channels, zq_channels, groups)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, kernel_size=1) for _ in range(4))

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:  # x [B, c, H', W']
        b, c, hh, ww = x.shape
        n = self.norm(x, zq)

        def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, c, H', W'] -> [B, 1, H'W', c]
            return t.reshape(b, c, hh * ww).transpose(1, 2).unsqueeze(1)

        out = F.scaled_dot_product_attention(tokens(self.q(n)), tokens(self.k(n)), tokens(self.v(n)))
        return x + self.proj_out(out.squeeze(1).transpose(1, 2).reshape(b, c, hh, ww))


class _SpatialLevel(nn.Module):
    """One decoder level: `res` blocks, `attn` blocks (lowest resolution), then `upsample` except at full size."""

    def __init__(self, res: nn.ModuleList, attn: nn.ModuleList, upsample: nn.Module | None) -> None:
        super().__init__()
        self.res, self.attn = res, attn
        if upsample is not None:
            self.upsample = upsample

    def forward(self, h: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.res):
            h = block(h, zq)
            if len(self.attn) > 0:
                h = self.attn[i](h, zq)
        return self.upsample(h) if hasattr(self, "upsample") else h


class MoVQDecoder(nn.Module):
    """[B, z_channels, h, w] and zq [B, C, h, w] -> [B, out_channels, 8 h, 8 w] (for ch_mult of 4 levels);
    `conv_blocks[0]` is the lowest resolution."""

    def __init__(self, out_channels: int, ch: int, ch_mult: Sequence[int], num_res_blocks: int, z_channels: int,
                 zq_channels: int, groups: int, level_attention: bool) -> None:
        super().__init__()
        last = len(ch_mult) - 1
        block_in = ch * ch_mult[last]
        self.conv_in = nn.Conv2d(z_channels, block_in, kernel_size=3, padding=1)
        self.mid = nn.ModuleList([SpatialResnetBlock(block_in, block_in, zq_channels, groups),
                                  SpatialAttnBlock(block_in, zq_channels, groups),
                                  SpatialResnetBlock(block_in, block_in, zq_channels, groups)])
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(ch_mult))):
            block_out = ch * ch_mult[level]
            res = nn.ModuleList([SpatialResnetBlock(block_in if j == 0 else block_out, block_out, zq_channels, groups)
                                 for j in range(num_res_blocks + 1)])
            n_attn = num_res_blocks + 1 if level == last and level_attention else 0
            attn = nn.ModuleList([SpatialAttnBlock(block_out, zq_channels, groups) for _ in range(n_attn)])
            self.conv_blocks.append(_SpatialLevel(res, attn, Upsample(block_out) if level != 0 else None))
            block_in = block_out
        self.norm_out = SpatialNorm(block_in, zq_channels, groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, kernel_size=3, padding=1)

    def forward(self, z: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h, zq)
        for level in self.conv_blocks:
            h = level(h, zq)
        return self.conv_out(F.silu(self.norm_out(h, zq)))


class MoVQGAN(ModelMixin, ConfigMixin):
    """MoVQGAN; defaults are the official 270M model (`movqgan_270M.ckpt`): 16384 codes of 4, ch 256, ch_mult
    (1, 2, 2, 4), 2 blocks a level, z 4, GroupNorm(32), attention at the lowest level. Codes are [B, h, w] in raster
    order, h = H / downsample_factor."""

    @register_to_config
    def __init__(self, codebook_size: int = 16384, codebook_embed_dim: int = 4, z_channels: int = 4, ch: int = 256,
                 ch_mult: Sequence[int] = (1, 2, 2, 4), num_res_blocks: int = 2, level_attention: bool = True,
                 norm_num_groups: int = 32, in_channels: int = 3, out_channels: int = 3) -> None:
        super().__init__()
        mult = tuple(ch_mult)
        check(all(ch * m % norm_num_groups == 0 for m in mult),
              f"norm_num_groups={norm_num_groups} must divide every width ch * mult ({[ch * m for m in mult]}).")
        self.encoder = Encoder(in_channels, ch, mult, num_res_blocks, z_channels, 0.0, norm_num_groups,
                               level_attention)
        self.quant_conv = nn.Conv2d(z_channels, codebook_embed_dim, kernel_size=1)
        self.quantize = VectorQuantizer(codebook_size, codebook_embed_dim, 0.25, 0.0, False, False)
        self.post_quant_conv = nn.Conv2d(codebook_embed_dim, z_channels, kernel_size=1)
        self.decoder = MoVQDecoder(out_channels, ch, mult, num_res_blocks, z_channels, codebook_embed_dim,
                                   norm_num_groups, level_attention)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config.ch_mult) - 1)

    def encode_ids(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] in [-1, 1] -> codes [B, H / f, W / f]."""
        return self.quantize(self.quant_conv(self.encoder(images.to(self.dtype))))[1]

    def decode(self, zq: torch.Tensor) -> torch.Tensor:
        """Code vectors zq [B, C, h, w] -> images [B, 3, f h, f w], nominally in [-1, 1]."""
        return self.decoder(self.post_quant_conv(zq), zq)

    def decode_code(self, ids: torch.Tensor, fill_missing: bool = False) -> torch.Tensor:
        """Codes [B, h, w] -> images [B, 3, f h, f w] (the official `decode_code`); with `fill_missing`, -1 (a code
        not generated) decodes from a zero vector."""
        check(ids.dim() == 3, f"codes must be [B, h, w], got {list(ids.shape)}.")
        zq = self.quantize.lookup(ids.clamp_min(0))  # [B, h, w, C]
        if fill_missing:
            zq = zq * (ids >= 0).unsqueeze(-1).to(zq.dtype)
        return self.decode(zq.permute(0, 3, 1, 2).to(self.dtype))


def infer_movqgan_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`MoVQGAN` arguments of an official state dict (CheckpointError in one line for another file)."""
    return taming_config(sd, "MoVQGAN", needed=("decoder.mid.block_1.norm1.conv_y.weight",))


def load_movqgan(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
                 allow_pickle: bool = False) -> MoVQGAN:
    """The official `movqgan_270M.ckpt` (a raw state dict, or one under `state_dict`) -> `MoVQGAN` in `dtype`, eval
    mode, every weight checked; read with `torch.load(weights_only=True)` unless `allow_pickle`."""
    check_float_dtype(dtype)
    model = convert_movqgan(load_state_dict(path, allow_pickle=allow_pickle))
    return nn.Module.to(model, dtype=dtype)


def is_movqgan(sd: dict[str, torch.Tensor]) -> bool:
    """Whether a taming-layout state dict is a MoVQGAN's (its decoder norms are spatial)."""
    return any(k.endswith("norm1.conv_y.weight") and k.startswith("decoder.") for k in sd)


def convert_movqgan(sd: dict[str, torch.Tensor]) -> MoVQGAN:
    """An official MoVQGAN state dict -> `MoVQGAN` in eval mode, every weight checked."""
    sd = strip_wrapper_prefixes(sd)
    model = MoVQGAN(**infer_movqgan_config(sd))
    load_into(model, rename_taming_keys(sd), ignore_unexpected=IGNORED_KEYS)
    return model.eval()
