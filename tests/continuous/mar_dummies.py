"""Tiny MAR components for the tests: 16 x 16 images, a 4x VAE (4 x 4 = 16 tokens of 16 channels)."""

import torch
from diffusers import AutoencoderKL

from continuous.mar.model import MARModel
from mmspec.testing import seeded_generators as generators  # noqa: F401  (the tests import it from here)

TINY_MAR = dict(img_size=16, vae_stride=4, vae_embed_dim=16, embed_dim=32, num_heads=2, encoder_depth=1,
                decoder_depth=1, buffer_size=4, diffloss_d=1, diffloss_w=32, attn_dropout=0.0, proj_dropout=0.0)
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 8),
                down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                layers_per_block=1, norm_num_groups=4, sample_size=16)


def tiny_mar(seed: int, num_classes: int = 4, **overrides) -> MARModel:
    """A tiny MAR whose diffusion head's zero-initialised output layers are perturbed, so it predicts something."""
    torch.manual_seed(seed)
    model = MARModel(**{**TINY_MAR, "num_classes": num_classes, **overrides}).eval()
    with torch.no_grad():
        for p in model.diffloss.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(**TINY_VAE).eval()
