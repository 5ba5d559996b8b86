"""Image outputs of the pipelines: float images in [0, 1] as PIL images, numpy arrays or torch tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import PIL.Image
import torch

from mmspec.errors import check

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def check_output_type(output_type: str) -> None:
    check(output_type in OUTPUT_TYPES, f"output_type must be pil/np/pt/latent, got {output_type!r}.")


def format_images(images: torch.Tensor, output_type: str) -> Any:
    """images [N, 3, H, W] in [0, 1] -> "pt" (as is, float32), "np" ([N, H, W, 3]) or "pil" (a list)."""
    images = images.clamp(0, 1).float()
    if output_type == "pt":
        return images
    array = images.permute(0, 2, 3, 1).cpu().numpy()  # [N, H, W, 3]
    if output_type == "np":
        return array
    return [PIL.Image.fromarray((a * 255).round().astype(np.uint8)) for a in array]
