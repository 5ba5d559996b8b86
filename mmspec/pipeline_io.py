"""Inputs and outputs shared by the image pipelines: class labels and per-image generators in, float images in
[0, 1] out as PIL images, numpy arrays or torch tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import PIL.Image
import torch

from mmspec.errors import InputError, check

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def class_labels_tensor(class_labels: Any, num_images_per_prompt: int, num_classes: int,
                        device: torch.device | str) -> torch.Tensor:
    """Class ids (an int, a list or a tensor) checked against the model's classes, each repeated
    num_images_per_prompt times: [N] int64 on `device`."""
    check(class_labels is not None, "pass class_labels (an int, a list of ints or a tensor of class ids).")
    labels = torch.as_tensor([class_labels] if isinstance(class_labels, int) else class_labels).long()
    check(labels.dim() == 1 and labels.numel() > 0, "class_labels must be an int or a 1-D list of ints.")
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.numel():
        raise InputError(f"class label(s) {bad.tolist()} outside [0, {num_classes}); this model has {num_classes} "
                         "classes.")
    return labels.repeat_interleave(num_images_per_prompt).to(device)


def check_generators(generator: Any, batch: int) -> None:
    """A list of generators must hold one per image."""
    if isinstance(generator, list):
        check(len(generator) == batch, f"got {len(generator)} generators for {batch} images; pass one per image "
              "(num_images_per_prompt x conditions), one generator, or None.")


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
