"""The LDM / taming-transformers convolutional encoder and decoder shared by the image tokenizers: LlamaGen's VQ
(`image_ar.llamagen.vq`, also Chameleon's VQGAN through its preset), and VAR's multi-scale VQVAE
(`image_ar.var.vqvae`) use the same modules.

    Encoder: conv_in; one level per ch_mult entry (num_res_blocks ResnetBlocks, + an AttnBlock after each of them
             at the lowest resolution when `level_attention`, + a stride-2 Downsample except at the last level);
             mid = Resnet, Attn, Resnet; GroupNorm, swish, conv_out [B, 3, H, W] -> [B, z_channels, H / f, W / f]
    Decoder: the mirror image with num_res_blocks + 1 blocks per level and nearest-neighbour x2 Upsample
                                                                    [B, z_channels, h, w] -> [B, 3, h * f, w * f]

f = 2 ** (len(ch_mult) - 1). `level_attention` False is taming's `attn_resolutions: []` (Chameleon's VQGAN): the
mid block keeps its attention. Module names follow LlamaGen's official keys (`conv_blocks.{i}.res.{j}`,
`...attn.{j}.q`, `mid.{0,1,2}`, `nin_shortcut`); `rename_taming_keys` maps taming's own names (VAR's and
Chameleon's checkpoints) onto them. Attention uses `F.scaled_dot_product_attention` (scale 1/sqrt(C), as the
official code).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmspec.errors import CheckpointError


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """norm1 -> swish -> conv1 -> norm2 -> swish -> dropout -> conv2, plus the (1x1 `nin_shortcut`) skip."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float, groups: int) -> None:
        super().__init__()
        self.norm1 = _norm(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.norm2 = _norm(out_channels, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, Cin, h, w] -> [B, Cout, h, w]
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the h*w positions, with 1x1 conv projections q, k, v, proj_out."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = _norm(channels, groups)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, C, h, w] -> [B, C, h, w]
        b, c, hh, ww = x.shape
        n = self.norm(x)

        def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, C, h, w] -> [B, 1, h*w, C]
            return t.reshape(b, c, hh * ww).transpose(1, 2).unsqueeze(1)

        out = F.scaled_dot_product_attention(tokens(self.q(n)), tokens(self.k(n)), tokens(self.v(n)))  # [B,1,hw,C]
        out = out.squeeze(1).transpose(1, 2).reshape(b, c, hh, ww)  # [B, C, h, w]
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Zero-pad right and bottom by one, then a 3x3 stride-2 conv: [B, C, h, w] -> [B, C, h/2, w/2]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv: [B, C, h, w] -> [B, C, 2h, 2w]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: `res` blocks, `attn` blocks (lowest resolution only), optional `downsample` or
    `upsample` (the attribute names are the official state-dict keys)."""

    def __init__(self, res: nn.ModuleList, attn: nn.ModuleList, resample: tuple[str, nn.Module] | None) -> None:
        super().__init__()
        self.res = res
        self.attn = attn
        if resample is not None:
            self.add_module(*resample)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.res):
            h = block(h)
            if len(self.attn) > 0:
                h = self.attn[i](h)
        if hasattr(self, "downsample"):
            h = self.downsample(h)
        if hasattr(self, "upsample"):
            h = self.upsample(h)
        return h


def _mid(channels: int, dropout: float, groups: int) -> nn.ModuleList:
    return nn.ModuleList(
        [
            ResnetBlock(channels, channels, dropout, groups),
            AttnBlock(channels, groups),
            ResnetBlock(channels, channels, dropout, groups),
        ]
    )


class Encoder(nn.Module):
    """[B, in_channels, H, W] -> [B, z_channels, H / f, W / f]."""

    def __init__(self, in_channels: int, ch: int, ch_mult: Sequence[int], num_res_blocks: int, z_channels: int,
                 dropout: float, groups: int, level_attention: bool = True) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, stride=1, padding=1)
        last = len(ch_mult) - 1
        block_in = ch
        self.conv_blocks = nn.ModuleList()
        for level, mult in enumerate(ch_mult):
            block_out = ch * mult
            res = nn.ModuleList()
            for j in range(num_res_blocks):
                res.append(ResnetBlock(block_in if j == 0 else block_out, block_out, dropout, groups))
            n_attn = num_res_blocks if level == last and level_attention else 0
            attn = nn.ModuleList([AttnBlock(block_out, groups) for _ in range(n_attn)])
            resample = ("downsample", Downsample(block_out)) if level != last else None
            self.conv_blocks.append(_Level(res, attn, resample))
            block_in = block_out
        self.mid = _mid(block_in, dropout, groups)
        self.norm_out = _norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, z_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)  # [B, ch, H, W]
        for level in self.conv_blocks:
            h = level(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))  # [B, z_channels, h, w]


class Decoder(nn.Module):
    """[B, z_channels, h, w] -> [B, out_channels, h * f, w * f]; `conv_blocks[0]` is the lowest resolution."""

    def __init__(self, out_channels: int, ch: int, ch_mult: Sequence[int], num_res_blocks: int, z_channels: int,
                 dropout: float, groups: int, level_attention: bool = True) -> None:
        super().__init__()
        last = len(ch_mult) - 1
        block_in = ch * ch_mult[last]
        self.conv_in = nn.Conv2d(z_channels, block_in, kernel_size=3, stride=1, padding=1)
        self.mid = _mid(block_in, dropout, groups)
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(ch_mult))):
            block_out = ch * ch_mult[level]
            res = nn.ModuleList()
            for j in range(num_res_blocks + 1):
                res.append(ResnetBlock(block_in if j == 0 else block_out, block_out, dropout, groups))
            n_attn = num_res_blocks + 1 if level == last and level_attention else 0
            attn = nn.ModuleList([AttnBlock(block_out, groups) for _ in range(n_attn)])
            resample = ("upsample", Upsample(block_out)) if level != 0 else None
            self.conv_blocks.append(_Level(res, attn, resample))
            block_in = block_out
        self.norm_out = _norm(block_in, groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)  # [B, ch * ch_mult[-1], h, w]
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))  # [B, out_channels, H, W]


_MID = {"block_1": "0", "attn_1": "1", "block_2": "2"}


def taming_levels(sd: Mapping[str, object], prefix: str) -> int:
    """How many `{prefix}.{i}.` levels a taming state dict holds (0 when none)."""
    found = [int(m.group(1)) for k in sd if (m := re.match(rf"^{re.escape(prefix)}\.(\d+)\.", k))]
    return 1 + max(found) if found else 0


def rename_taming_keys(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A taming-transformers autoencoder's keys -> this module's (other keys pass unchanged):

        encoder.down.{i}.block.{j}.* / attn.{j}.* / downsample.conv -> encoder.conv_blocks.{i}.res.{j} / attn.{j} / ...
        {encoder,decoder}.mid.block_1 / attn_1 / block_2             -> .mid.0 / .mid.1 / .mid.2
        decoder.up.{i}.*  -> decoder.conv_blocks.{n - 1 - i}.* (taming's `up[i]` is resolution level i; here the
                             decoder lists its levels from the lowest resolution), block.{j} -> res.{j}
        ...attn.{j}.qkv   -> ...attn.{j}.{q,k,v} (VAR's fused 1x1 conv split in three along its output channels)
    """
    n_up = taming_levels(sd, "decoder.up")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        new = re.sub(r"^encoder\.down\.(\d+)\.block\.", r"encoder.conv_blocks.\1.res.", key)
        new = re.sub(r"^encoder\.down\.(\d+)\.", r"encoder.conv_blocks.\1.", new)
        new = re.sub(r"^decoder\.up\.(\d+)\.", lambda m: f"decoder.conv_blocks.{n_up - 1 - int(m.group(1))}.", new)
        new = re.sub(r"^(decoder\.conv_blocks\.\d+)\.block\.", r"\1.res.", new)
        new = re.sub(r"^(encoder|decoder)\.mid\.(block_1|attn_1|block_2)\.",
                     lambda m: f"{m.group(1)}.mid.{_MID[m.group(2)]}.", new)
        if re.search(r"\.qkv\.(weight|bias)$", new):
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out[re.sub(r"\.qkv\.", f".{name}.", new)] = part.clone()
        else:
            out[new] = value
    return out


def taming_config(sd: Mapping[str, torch.Tensor], what: str, needed: tuple[str, ...] = ()) -> dict:
    """The shape of a taming VQ autoencoder's state dict: codebook_size and codebook_embed_dim (`quantize.
    embedding`), ch (`encoder.conv_in`), ch_mult (each level's first block), num_res_blocks, z_channels
    (`quant_conv`) and level_attention (attention blocks in `encoder.down`); CheckpointError in one line, naming
    `what` it is not, when these or `needed` keys are missing."""
    keys = ("quantize.embedding.weight", "encoder.conv_in.weight", "quant_conv.weight",
            "encoder.down.0.block.0.conv1.weight", *needed)
    missing = [k for k in keys if k not in sd]
    if missing:
        raise CheckpointError(f"not a {what} checkpoint: {', '.join(missing)} missing (found e.g. "
                              f"{', '.join(list(sd)[:5])}).")
    codes, dim = sd["quantize.embedding.weight"].shape
    ch = sd["encoder.conv_in.weight"].shape[0]
    return {"codebook_size": codes, "codebook_embed_dim": dim, "ch": ch,
            "ch_mult": tuple(sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch
                             for i in range(taming_levels(sd, "encoder.down"))),
            "num_res_blocks": taming_levels(sd, "encoder.down.0.block"), "z_channels": sd["quant_conv.weight"].shape[1],
            "level_attention": any(re.match(r"^encoder\.down\.\d+\.attn\.", k) for k in sd)}
