"""The KL VAE of the MAR family: a diffusers `AutoencoderKL`, and the conversions between images, VAE latents and
MAR's scaled latents.

The official KL-16 (`kl16.ckpt`) is `AutoencoderKL` with latent_channels 16, block_out_channels 128 x (1, 1, 2, 2, 4),
2 res blocks per level, attention in the last encoder level (the LDM encoder's `attn_resolutions=(16,)` at
256 px) and none in the decoder: 256 px -> 16 x 16 x 16 latents, scaled by 0.2325 (`scaling_factor`). The world
VAE is the same kind at 32 px: 32 -> 8 x 8 x 16 latents (64 tokens), its scaling factor measured after training.

    vae = AutoencoderKL(**KL16_CONFIG)                 # or world_vae(); or AutoencoderKL.from_pretrained(folder)
    latents = encode_latents(vae, images, generator)   # [B, 16, h, w], scaled, images in [-1, 1]
    images = decode_latents(vae, latents)              # [B, 3, H, W] in [-1, 1]
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL

KL16_CONFIG = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 128, 256, 256, 512),
                   down_block_types=("DownEncoderBlock2D",) * 4 + ("AttnDownEncoderBlock2D",),
                   up_block_types=("UpDecoderBlock2D",) * 5, layers_per_block=2, norm_num_groups=32,
                   sample_size=256, scaling_factor=0.2325)
WORLD_VAE_CONFIG = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 64, 64),
                        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                        layers_per_block=1, norm_num_groups=8, sample_size=32, scaling_factor=1.0)


def world_vae() -> AutoencoderKL:
    """A fresh world KL VAE: 32 x 32 images -> 8 x 8 x 16 latents."""
    return AutoencoderKL(**WORLD_VAE_CONFIG)


def vae_stride(vae: AutoencoderKL) -> int:
    """Image pixels per latent position (2 ^ number of downsampling levels)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def encode_latents(vae: AutoencoderKL, images: torch.Tensor, generator: torch.Generator | None = None,
                   sample: bool = True) -> torch.Tensor:
    """Scaled latents [B, c, h, w] of images [B, 3, H, W] in [-1, 1]: a posterior sample (MAR's training
    input), or the posterior mean with sample=False."""
    posterior = vae.encode(images).latent_dist
    latents = posterior.sample(generator) if sample else posterior.mean
    return latents * vae.config.scaling_factor


def decode_latents(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] (not clamped) from scaled latents."""
    return vae.decode(latents / vae.config.scaling_factor).sample
