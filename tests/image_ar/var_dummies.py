"""Tiny VAR components for the pipeline tests (diffusers' get_dummy_components convention)."""

import torch

from image_ar.var import VARVQVAE, VARTransformer

PNS = (1, 2, 4)  # 21 tokens, 8x8 images with the 2x VQVAE


def get_dummy_components() -> dict:
    torch.manual_seed(0)
    transformer = VARTransformer(vocab_size=16, cvae=4, num_classes=3, depth=2, embed_dim=16, num_heads=2,
                                 patch_nums=PNS).eval()
    with torch.no_grad():  # a trained model's logits are far from uniform; random small weights are not
        transformer.head.weight.mul_(20)
    vqvae = VARVQVAE(vocab_size=16, z_channels=4, ch=8, ch_mult=(1, 2), num_res_blocks=1, norm_num_groups=4,
                     patch_nums=PNS).eval()
    return {"transformer": transformer, "vqvae": vqvae}


def small_refiner() -> VARTransformer:
    """A smaller VAR over the same VQVAE and classes: CoDe's refiner."""
    torch.manual_seed(5)
    return VARTransformer(vocab_size=16, cvae=4, num_classes=3, depth=1, embed_dim=8, num_heads=2,
                          patch_nums=PNS).eval()
