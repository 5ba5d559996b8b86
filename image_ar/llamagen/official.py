"""LlamaGen at its official sizes with random weights: what a forward costs at the sizes users run.

    pipe = random_pipeline("XL", device="cuda", dtype=torch.bfloat16)   # GPT-XL + VQ-16 + EAGLE head + GPT-B draft
    mmspec bench --family llamagen --family-option size=XL --force-acceptance tau=3.0:depth=5 ...

No weights can be downloaded here, and a forward costs the same whatever the weights, so these pipelines time the
methods at official sizes; their acceptance comes from `mmspec bench --force-acceptance` (`mmspec.forced`), never
from these models. The configurations are the official ones (FoundationVision/LlamaGen):
- the class-conditional GPT (`autoregressive/models/gpt.py`, `GPT_models`; `gpt.PRESETS`): B 12 layers x 768,
  L 24 x 1024, XL 36 x 1280, XXL 48 x 1536, 3B 24 x 3200; vocabulary 16384, 1000 classes, one condition token,
  256 image tokens at 256 px (`image_size=384`: 576);
- the VQ-16 tokenizer (`tokenizer/tokenizer_image/vq_model.py`, `VQ_16`): codebook 16384 x 8, l2-normalised, 128
  channels, channel multipliers 1, 1, 2, 2, 4 (`LlamaGenVQ`'s defaults);
- an EAGLE drafter of one decoder layer at the target's width (`LlamaGenEagleDrafter.for_target`), the drafter
  shape LANTERN (arXiv 2410.03355) trained for LlamaGen;
- for `draft-model`, a smaller official size (`draft_size`, default B; none for B itself).
Weights are drawn on the device itself (N(0, 0.02), as the official init, except the output head, which the
official init zeroes and which gets N(0, 0.02 x `logit_scale`) here so that logits are not all equal), then cast to
`dtype`. `logit_scale` > 1 makes the distributions (the target's, and the EAGLE drafter's, which shares the head) as
peaked as a trained model's: a random drafter's flat distributions make EAGLE-2 keep wide trees two levels deep,
which cap the acceptance a forced run can reach (LlamaGen-B: 2.44 tokens a step at scale 1, 3.59 at 40, against a
profile of 3.60; docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from image_ar.llamagen.eagle import LlamaGenEagleDrafter
from image_ar.llamagen.gpt import LlamaGenGPT, preset_sizes
from image_ar.llamagen.pipeline import LlamaGenPipeline
from image_ar.llamagen.vq import LlamaGenVQ
from mmspec.diffusers_folder import cast_like_loaded
from mmspec.errors import check

IMAGE_SIZES = {256: 256, 384: 576}  # image size in pixels -> image tokens (a 16x downsampling VQ)
INIT_STD = 0.02


def random_gpt(size: str, block_size: int, device: torch.device | str, logit_scale: float = 1.0) -> LlamaGenGPT:
    """An official-size class-conditional GPT with random weights on `device` (float32), its output head drawn
    with std INIT_STD x logit_scale."""
    preset_sizes(size)  # (InputError naming the presets)
    check(logit_scale > 0, f"logit_scale must be > 0, got {logit_scale}.")
    with torch.device(device):
        model = LlamaGenGPT.from_preset(size, block_size=block_size)
        torch.nn.init.normal_(model.output.weight, std=INIT_STD * logit_scale)
    return model


def random_pipeline(size: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    draft_size: str | None = "B", image_size: int = 256, seed: int = 0,
                    logit_scale: float = 1.0) -> LlamaGenPipeline:
    """LlamaGenPipeline of the official `size` with random weights (see the module docstring); `draft_size` None
    or equal to `size` gives no draft model."""
    check(image_size in IMAGE_SIZES, f"image_size must be one of {', '.join(map(str, IMAGE_SIZES))}, "
                                     f"got {image_size!r}.")
    torch.manual_seed(seed)
    block_size = IMAGE_SIZES[image_size]
    transformer = random_gpt(size, block_size, device, logit_scale)
    eagle = LlamaGenEagleDrafter.for_target(transformer)
    draft = None
    if draft_size is not None and preset_sizes(draft_size) != preset_sizes(size):
        draft = cast_like_loaded(random_gpt(draft_size, block_size, device, logit_scale), dtype)
    with torch.device(device):
        vqvae = LlamaGenVQ()
    pipe = LlamaGenPipeline(transformer=cast_like_loaded(transformer, dtype), vqvae=cast_like_loaded(vqvae, dtype),
                            draft_transformer=draft, eagle_drafter=cast_like_loaded(eagle, dtype))
    pipe.set_progress_bar_config(disable=True)  # (as a loaded folder's)
    return pipe
