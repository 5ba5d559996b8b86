"""MAR at its official sizes with random weights: what a MAR step and a CSpD window cost at the sizes users run.

    pipe = random_pipeline("L", draft_size="B", device="cuda", dtype=torch.bfloat16)  # CSpD: MAR-L, MAR-B draft
    mmspec bench --family mar --family-option size=L --family-option draft_size=B --methods vanilla,cspd ...

A forward costs the same whatever the weights; CSpD's acceptance does not (it compares the draft's and the target's
Gaussians), so a random pair times every operation at its real size while its acceptance, and so its speed-up, is
not a trained pair's. The configurations are the official ones (LTH14/mar `models/mar.py` `mar_base` / `mar_large`
/ `mar_huge`, and the README's DiffLoss per size), 256 px through the KL-16 VAE (16 x 16 tokens of 16 channels,
`continuous.mar.vae.KL16_CONFIG`), 1000 classes, a 64-token class buffer:
- B: encoder and decoder 12 blocks x 768, 12 heads; DiffLoss MLP 6 blocks x 1024 (208M parameters);
- L: 16 blocks x 1024, 16 heads; DiffLoss 8 x 1280 (479M);
- H: 20 blocks x 1280, 16 heads; DiffLoss 12 x 1536 (943M).
CSpD (arXiv 2411.11925) drafts with MAR-B for MAR-L and MAR-H. Weights: the modules' own initialisation, on the
device, then cast to `dtype` (`mmspec.diffusers_folder.cast_like_loaded`).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL

from continuous.mar.cspd import CSpDPipeline
from continuous.mar.model import MARModel
from continuous.mar.pipeline import MARPipeline
from continuous.mar.vae import KL16_CONFIG
from mmspec.diffusers_folder import cast_like_loaded
from mmspec.errors import InputError

# size -> (width, blocks per encoder and decoder, heads, DiffLoss blocks, DiffLoss width)
SIZES = {"B": (768, 12, 12, 6, 1024), "L": (1024, 16, 16, 8, 1280), "H": (1280, 20, 16, 12, 1536)}


def parse_size(name: str) -> str:
    """'B' / 'mar-b' / 'base' -> 'B'; InputError naming the official sizes otherwise."""
    text = str(name).upper().removeprefix("MAR-").removeprefix("MAR_")
    text = {"BASE": "B", "LARGE": "L", "HUGE": "H"}.get(text, text)
    if text not in SIZES:
        raise InputError(f"unknown MAR size {name!r}; official sizes: {', '.join(SIZES)} (MAR-B, MAR-L, MAR-H).")
    return text


def official_mar(size: str) -> MARModel:
    """The official MAR of `size` at 256 px (see the module docstring), on the current default device."""
    width, depth, heads, head_depth, head_width = SIZES[parse_size(size)]
    return MARModel(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16, embed_dim=width, num_heads=heads,
                    encoder_depth=depth, decoder_depth=depth, num_classes=1000, buffer_size=64,
                    diffloss_d=head_depth, diffloss_w=head_width)


def random_pipeline(size: str, draft_size: str | None = "B", device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> CSpDPipeline | MARPipeline:
    """CSpDPipeline(MAR-`size`, MAR-`draft_size` draft) with random weights, or a MARPipeline when `draft_size` is
    None or `size` itself."""
    size = parse_size(size)
    draft_size = None if draft_size is None else parse_size(draft_size)
    torch.manual_seed(seed)
    with torch.device(device):
        target, vae = official_mar(size).eval(), AutoencoderKL(**KL16_CONFIG).eval()
        draft = None if draft_size in (None, size) else official_mar(draft_size).eval()
    target, vae = cast_like_loaded(target, dtype), cast_like_loaded(vae, dtype)
    if draft is None:
        pipe = MARPipeline(transformer=target, vae=vae)
    else:
        pipe = CSpDPipeline(target=target, draft=cast_like_loaded(draft, dtype), vae=vae)
    pipe.set_progress_bar_config(disable=True)
    return pipe
