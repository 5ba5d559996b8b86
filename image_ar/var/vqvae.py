"""VAR's multi-scale VQVAE as a diffusers model: the LDM-style convolutional encoder/decoder, 3x3 quant convs,
and the residual multi-scale quantiser (`image_ar/var/quantizer.py`).

Facts: VAR (arXiv 2404.02905; FoundationVision/VAR `models/vqvae.py`): vocab 4096, Cvae = z_channels 32, ch 160, ch_mult
(1, 1, 2, 2, 4) (16x downsampling), 2 residual blocks per level, self-attention at the lowest resolution and in the
middle. The encoder and decoder are the same LDM/taming modules as LlamaGen's tokenizer (`image_ar.conv_autoencoder`,
one implementation); the official VAR state dict names them differently (`encoder.down.{i}.block.{j}`, a fused
`attn.qkv` conv, `mid.block_1`), which its converter maps.

    images [B, 3, H, W] in [-1, 1] -> encoder -> quant_conv -> f [B, Cvae, pn_last, pn_last]
    f -> quantize.encode -> code pyramid [[B, pn_0^2], ..., [B, pn_last^2]]
    pyramid -> quantize.decode_pyramid -> f_hat -> post_quant_conv -> decoder -> images (clamped to [-1, 1])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from image_ar.conv_autoencoder import Decoder, Encoder
from image_ar.var.quantizer import MultiScaleQuantizer
from image_ar.var.transformer import check_patch_nums
from mmspec.errors import check
from mmspec.vae_slicing import SlicedDecodeMixin


class VARVQVAE(SlicedDecodeMixin, ModelMixin, ConfigMixin):
    """Multi-scale VQVAE (see the module docstring); `downsample` = 2 ** (len(ch_mult) - 1)."""

    @register_to_config
    def __init__(self, vocab_size: int = 4096, z_channels: int = 32, ch: int = 160,
                 ch_mult: Sequence[int] = (1, 1, 2, 2, 4), num_res_blocks: int = 2, dropout: float = 0.0,
                 beta: float = 0.25, using_znorm: bool = False, quant_conv_ks: int = 3, quant_resi: float = 0.5,
                 share_quant_resi: int = 4, norm_num_groups: int = 32,
                 patch_nums: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)) -> None:
        super().__init__()
        pns = check_patch_nums(patch_nums)
        widths = [ch] + [ch * m for m in ch_mult]
        check(all(w % norm_num_groups == 0 for w in widths),
              f"every width ({widths}) must be divisible by norm_num_groups ({norm_num_groups}).")
        self.downsample = 2 ** (len(ch_mult) - 1)
        self.encoder = Encoder(3, ch, ch_mult, num_res_blocks, z_channels, dropout, norm_num_groups)
        self.decoder = Decoder(3, ch, ch_mult, num_res_blocks, z_channels, dropout, norm_num_groups)
        self.quant_conv = nn.Conv2d(z_channels, z_channels, quant_conv_ks, stride=1, padding=quant_conv_ks // 2)
        self.post_quant_conv = nn.Conv2d(z_channels, z_channels, quant_conv_ks, stride=1, padding=quant_conv_ks // 2)
        self.quantize = MultiScaleQuantizer(vocab_size, z_channels, pns, quant_resi, share_quant_resi, using_znorm,
                                            beta)

    @property
    def image_size(self) -> int:
        return self.config.patch_nums[-1] * self.downsample

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] in [-1, 1] -> f [B, Cvae, H / f, W / f]."""
        size = self.image_size
        check(images.dim() == 4 and images.shape[1] == 3 and images.shape[-2:] == (size, size),
              f"images must be [B, 3, {size}, {size}] (last patch size x {self.downsample}), got "
              f"{list(images.shape)}.")
        return self.quant_conv(self.encoder(images))

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> list[torch.Tensor]:
        """images -> code pyramid (one [B, pn^2] tensor per scale)."""
        return self.quantize.encode(self.features(images))

    def fhat_to_images(self, f_hat: torch.Tensor) -> torch.Tensor:
        """f_hat [B, Cvae, h, w] -> images [B, 3, H, W] clamped to [-1, 1]."""
        f_hat = f_hat.to(self.post_quant_conv.weight.dtype)  # the quantizer accumulates f_hat in float32
        return self.decode_slices(self.decoder, self.post_quant_conv(f_hat)).clamp(-1, 1)  # see enable_slicing

    def decode(self, pyramid: Sequence[torch.Tensor]) -> torch.Tensor:
        """code pyramid -> images [B, 3, H, W] in [-1, 1]."""
        return self.fhat_to_images(self.quantize.decode_pyramid(pyramid))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: (reconstruction [B, 3, H, W], VQ loss) with the straight-through estimator."""
        f_hat, vq_loss = self.quantize(self.features(images))
        return self.decoder(self.post_quant_conv(f_hat)), vq_loss
