"""Independent reference blocks of the taming / LDM convolutional autoencoder for the VQ converter tests (written
from the published facts, with the official module names: `norm1`, `conv1`, `nin_shortcut`, `q` / `k` / `v` /
`proj_out` with bmm attention, zero-padded stride-2 downsampling, nearest x2 upsampling)."""

import re

import torch
import torch.nn.functional as F
from torch import nn


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def gn(c: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, c, eps=1e-6)


class RefRes(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1, self.conv1 = gn(cin, groups), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = gn(cout, groups), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv2(swish(self.norm2(self.conv1(swish(self.norm1(x))))))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class RefAttn(nn.Module):
    def __init__(self, c: int, groups: int):
        super().__init__()
        self.norm = gn(c, groups)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        n = self.norm(x)
        q = self.q(n).reshape(b, c, h * w).permute(0, 2, 1)  # [b, hw, c]
        k = self.k(n).reshape(b, c, h * w)  # [b, c, hw]
        v = self.v(n).reshape(b, c, h * w)  # [b, c, hw]
        attn = torch.softmax(torch.bmm(q, k) * c**-0.5, dim=2)  # [b, hw_q, hw_k]
        out = torch.bmm(v, attn.permute(0, 2, 1)).reshape(b, c, h, w)
        return x + self.proj_out(out)


class RefDown(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class RefUp(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def taming_names(sd: dict, levels: int) -> dict:
    """mmspec's autoencoder keys -> the official taming ones (`encoder.down.{i}.block.{j}`, `decoder.up.{i}` with
    level 0 at full size, `mid.block_1 / attn_1 / block_2`): an inverse of `rename_taming_keys` written from the
    official layout, to make official-layout files from mmspec models."""
    out = {}
    for key, value in sd.items():
        key = re.sub(r"^encoder\.conv_blocks\.(\d+)\.res\.", r"encoder.down.\1.block.", key)
        key = re.sub(r"^encoder\.conv_blocks\.", "encoder.down.", key)
        key = re.sub(r"^decoder\.conv_blocks\.(\d+)\.", lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.", key)
        key = re.sub(r"^(decoder\.up\.\d+)\.res\.", r"\1.block.", key)
        key = re.sub(r"\.mid\.([012])\.", lambda m: f".mid.{('block_1', 'attn_1', 'block_2')[int(m.group(1))]}.", key)
        out[key] = value
    return out
