"""VAR at its official sizes with random weights: what CoDe's split costs at the sizes users run.

    pipe = random_pipeline(30, small_depth=16, device="cuda", dtype=torch.bfloat16)   # CoDe: VAR-d30 -> VAR-d16
    mmspec bench --family var --family-option size=d30 --family-option small_size=d16 --methods vanilla,code ...

A forward costs the same whatever the weights, and CoDe accepts nothing (the large model makes the first scales,
the small one the rest), so its speed-up needs no trained weights; its quality does. The configurations are the
official ones (FoundationVision/VAR `models/__init__.py` `build_vae_var`, 256 px): depth d, width 64 d, d heads,
MLP ratio 4, L2-normalised attention, no shared AdaLN, 1000 classes, the ten scales 1..16 (680 tokens); VAR-d16 310M,
d20 600M, d24 1.0B, d30 2.0B parameters; the multi-scale VQVAE (`VARVQVAE`'s defaults: 4096 codes x 32, 160 channels).
CoDe (arXiv 2411.17787) pairs VAR-d30 with VAR-d16. Weights: the modules' own initialisation, on the device, then
cast to `dtype`.
"""

from __future__ import annotations

import torch

from image_ar.var.code import CoDePipeline
from image_ar.var.pipeline import VARPipeline
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE
from mmspec.diffusers_folder import cast_like_loaded
from mmspec.errors import InputError

DEPTHS = (16, 20, 24, 30)  # the official 256 px sizes


def parse_size(name: str) -> int:
    """'d30' / '30' -> 30; InputError naming the official sizes otherwise."""
    text = str(name).lower().removeprefix("var-").removeprefix("d")
    if not text.isdigit() or int(text) not in DEPTHS:
        raise InputError(f"unknown VAR size {name!r}; official sizes: {', '.join(f'd{d}' for d in DEPTHS)}.")
    return int(text)


def random_pipeline(depth: int, small_depth: int | None = 16, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> CoDePipeline | VARPipeline:
    """CoDePipeline(VAR-d`depth`, VAR-d`small_depth`) with random weights, or a VARPipeline when `small_depth` is
    None or not smaller."""
    depth = parse_size(depth)
    torch.manual_seed(seed)
    with torch.device(device):
        large, vqvae = VARTransformer(depth=depth), VARVQVAE()
        small = None
        if small_depth is not None and parse_size(small_depth) < depth:
            small = VARTransformer(depth=parse_size(small_depth))
    vqvae, large = cast_like_loaded(vqvae, dtype), cast_like_loaded(large, dtype)
    if small is None:
        pipe = VARPipeline(transformer=large, vqvae=vqvae)
    else:
        pipe = CoDePipeline(drafter=large, refiner=cast_like_loaded(small, dtype), vqvae=vqvae)
    pipe.set_progress_bar_config(disable=True)
    return pipe
