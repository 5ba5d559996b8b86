"""The shape every image pipeline call shares (LlamaGen, VAR, MAR, CSpD, CoDe; Janus and Emu3 share its checks and
its end): check the class inputs and make the rows the models run (`class_run_fields` -> a `ClassRun`), run the
family's loop, then `finish_generation`: decode, format (PIL images, numpy arrays or torch tensors in [0, 1], or the
tokens for "latent") and return a `GenerationOutput` (images, tokens, stats), or `(images,)` with return_dict=False
as diffusers does. `check_no_inference_steps` refuses diffusers' `num_inference_steps`, which none of these
autoregressive pipelines has.

    run = ScaleRun(**class_run_fields(class_labels, 1, num_classes, generator, "pil", guided=True, device="cpu"),
                   ...)                                   # a family's own settings on top
    return finish_generation(pipe, tokens, lambda: decode(tokens), output_type, return_dict, stats)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers.utils import BaseOutput

from mmspec.errors import InputError, check
from mmspec.sampling import check_generator_types
from mmspec.stats import SpecStats

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def class_labels_tensor(class_labels: Any, num_images_per_prompt: int, num_classes: int,
                        device: torch.device | str) -> torch.Tensor:
    """Class ids (an int, a list or a tensor) checked against the model's classes, each repeated
    num_images_per_prompt times: [N] int64 on `device`."""
    check(class_labels is not None, "pass class_labels (an int, a list of ints or a tensor of class ids).")
    if isinstance(class_labels, torch.Tensor):
        labels = class_labels
        whole = not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
    else:  # (a numpy array's items as Python numbers, checked as a list's)
        items = class_labels.tolist() if isinstance(class_labels, np.ndarray) else class_labels
        items = [items] if isinstance(items, (int, np.integer)) else items
        whole = isinstance(items, (list, tuple)) and all(
            isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in items)
        labels = torch.as_tensor(items if whole else [])
    check(whole and labels.dim() == 1 and labels.numel() > 0, "class_labels must be a class id (int), a list of "
          f"them or a 1-D integer tensor, got {repr(class_labels)[:80]}.")
    labels = labels.long()
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.numel():
        raise InputError(f"class label(s) {bad.tolist()} outside [0, {num_classes}); this model has {num_classes} "
                         "classes.")
    return labels.repeat_interleave(num_images_per_prompt).to(device)


def check_generators(generator: Any, batch: int) -> None:
    """generator is None, one torch.Generator or a list of them holding one per image."""
    check_generator_types(generator)
    if isinstance(generator, (list, tuple)):
        check(len(generator) == batch, f"got {len(generator)} generators for {batch} images; pass one per image "
              "(num_images_per_prompt x conditions), one generator, or None.")


def check_no_inference_steps(num_inference_steps: Any, instead: str) -> None:
    """Refuse diffusers' `num_inference_steps` (a diffusion sampler's step count) in an autoregressive pipeline, whose
    step count it cannot set: one line, ending with `instead` (what sets that pipeline's steps). Call it first."""
    check(num_inference_steps is None, f"num_inference_steps is a diffusion sampler's step count; this pipeline is "
                                       f"autoregressive: {instead}")


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


# ------------------------------------------------------------------------------------- the shape of a call
@dataclass
class ClassRun:
    """The checked class inputs of one pipeline call: labels [B] (each class repeated num_images_per_prompt times),
    the rows the models run [R] (the labels, then the null class for each with CFG: R = 2B, else B) and whether
    guidance runs. Families extend it with their own settings (VAR: per-scale sampling; MAR: its randomness)."""

    labels: torch.Tensor
    rows: torch.Tensor
    guided: bool


def class_run_fields(class_labels: Any, num_images_per_prompt: int, num_classes: int, generator: Any,
                     output_type: str, guided: bool, device: torch.device | str) -> dict[str, Any]:
    """Check a call's shared arguments (clear errors, before any work) and return the `ClassRun` fields: labels,
    rows (null class = num_classes) and guided."""
    check_output_type(output_type)
    check(isinstance(num_images_per_prompt, int) and num_images_per_prompt >= 1,
          f"num_images_per_prompt must be an integer >= 1, got {num_images_per_prompt!r}.")
    labels = class_labels_tensor(class_labels, num_images_per_prompt, num_classes, device)
    check_generators(generator, labels.shape[0])
    rows = torch.cat([labels, torch.full_like(labels, num_classes)]) if guided else labels
    return {"labels": labels, "rows": rows, "guided": guided}


@dataclass
class GenerationOutput(BaseOutput):
    """What every image pipeline returns: images (PIL list, np [N, H, W, 3] or torch [N, 3, H, W] in [0, 1] by
    output_type; the tokens for "latent"), the generated tokens (discrete ids [N, L] or continuous [N, L, C]) and
    the run's `SpecStats` (target forwards = the main model's, draft forwards = the helper's)."""

    images: Any
    tokens: torch.Tensor
    stats: SpecStats

    @property
    def num_forwards(self) -> int:
        """Transformer forwards of the batch, every model counted."""
        return self.stats.num_target_forwards + self.stats.num_draft_forwards


def finish_generation(pipe: Any, tokens: torch.Tensor, decode: Callable[[], torch.Tensor], output_type: str,
                      return_dict: bool, stats: SpecStats, output_cls: type[GenerationOutput] = GenerationOutput,
                      **extra: Any) -> Any:
    """The end of every call: decode() -> images [N, 3, H, W] in [0, 1] (skipped for "latent", which returns the
    tokens), free offloaded models, and return `output_cls(images, tokens, stats, **extra)` or, without return_dict,
    the tuple `(images,)` as diffusers pipelines do (the tokens and stats are then not returned; they are kept only
    in the output object)."""
    images = tokens if output_type == "latent" else format_images(decode(), output_type)
    pipe.maybe_free_model_hooks()
    if not return_dict:
        return (images,)
    return output_cls(images=images, tokens=tokens, stats=stats, **extra)
