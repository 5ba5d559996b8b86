"""`VARPipeline`: vanilla next-scale generation with VAR (a diffusers `DiffusionPipeline`).

    pipe = VARPipeline(transformer=VARTransformer(...), vqvae=VARVQVAE(...))
    out = pipe(class_labels=[3, 7], guidance_scale=4.0, top_k=600, top_p=0.95, generator=gens)
    out.images, out.tokens   # images; codes of every scale [N, L]

One scale per step, as the official `autoregressive_infer_cfg`: the transformer reads scale si's input (the class
token map for si = 0, else the area-downsampled running f_hat) with its per-scale KV cache, the logits of the 2B
rows (conditional, then the null class) are guided with t = guidance_scale * si / (S - 1):
logits = (1 + t) cond - t uncond, i.e. `cfg_combine` with scale 1 + t; then temperature (a number or one per
scale), top-k, top-p, and sampling from the user's generator(s); the codes update f_hat through the quantiser.
`generate_scales` is the loop as a free function over a range of scales, so collaborative decoding (CoDe) can run
scales 0..N-1 with one model and the rest with another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from image_ar.var.quantizer import MultiScaleQuantizer
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE
from mmspec.cache import StaticKVCache
from mmspec.errors import InputError, check
from mmspec.images import check_output_type, format_images
from mmspec.sampling import Generators, SamplingParams, cfg_combine, sample_logits, split_cfg_batch


@dataclass
class VARPipelineOutput(BaseOutput):
    """images (output_type), tokens [N, L] (the codes of every scale, concatenated), forwards per image."""

    images: Any
    tokens: torch.Tensor
    num_forwards: int


@dataclass
class ScaleState:
    """Where a batch of B images stands: the codes sampled so far (one [B, pn^2] tensor per scale), the running
    f_hat [B, Cvae, H, W], and the next scale's input [B, pn^2, Cvae] (None before scale 1 / after the last)."""

    pyramid: list[torch.Tensor] = field(default_factory=list)
    f_hat: torch.Tensor | None = None
    next_input: torch.Tensor | None = None


def guidance_schedule(guidance_scale: float, num_scales: int) -> list[float]:
    """cfg_combine scales of every scale: 1 + guidance_scale * si / (S - 1) (official t = cfg * si / (S - 1))."""
    if num_scales == 1:
        return [1.0 + guidance_scale]
    return [1.0 + guidance_scale * si / (num_scales - 1) for si in range(num_scales)]


def per_scale(value: float | Sequence[float], num_scales: int, name: str) -> list[float]:
    """A number for every scale, or a list with one per scale."""
    if isinstance(value, (int, float)):
        return [float(value)] * num_scales
    values = [float(v) for v in value]
    check(len(values) == num_scales, f"{name} needs one value per scale ({num_scales}), got {len(values)}.")
    return values


def check_labels(class_labels: Any, num_images_per_prompt: int, num_classes: int, device: torch.device,
                 generator: Generators = None) -> torch.Tensor:
    """Class labels [N] (each repeated num_images_per_prompt times), checked against the model's classes and the
    number of generators."""
    check(isinstance(num_images_per_prompt, int) and num_images_per_prompt >= 1,
          f"num_images_per_prompt must be an integer >= 1, got {num_images_per_prompt!r}.")
    check(class_labels is not None, "pass class_labels (an int, a list of ints or a tensor of class ids).")
    labels = torch.as_tensor([class_labels] if isinstance(class_labels, int) else class_labels).long()
    check(labels.dim() == 1 and labels.numel() > 0, "class_labels must be an int or a 1-D list of ints.")
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.numel():
        raise InputError(f"class label(s) {bad.tolist()} outside [0, {num_classes}); this model has {num_classes} "
                         "classes.")
    labels = labels.repeat_interleave(num_images_per_prompt).to(device)
    if isinstance(generator, list):
        check(len(generator) == labels.shape[0], f"got {len(generator)} generators for {labels.shape[0]} images; "
                                                 "pass one per image, one generator, or None.")
    return labels


def generate_scales(model: VARTransformer, quantizer: MultiScaleQuantizer, labels: torch.Tensor,
                    state: ScaleState, cache: StaticKVCache, scales: range, guidance: list[float],
                    params: list[SamplingParams], generator: Generators = None, guided: bool = True,
                    on_scale: Callable[[int, ScaleState], None] | None = None) -> ScaleState:
    """Sample the scales in `scales` (consecutive, continuing `state`) for labels [B]; the cache holds 2B rows
    (conditional, then null class) when `guided`, else B."""
    b = labels.shape[0]
    rows = torch.cat([labels, torch.full_like(labels, model.config.num_classes)]) if guided else labels
    cond = model.condition(rows)  # [R, C]
    for si in scales:
        begin = model.bounds[si][0]
        if si == 0:
            h = model.first_token_map(cond)  # [R, 1, C]
        else:
            check(state.next_input is not None, f"scale {si} needs the input made by scale {si - 1}.")
            x = state.next_input.repeat(2, 1, 1) if guided else state.next_input  # [R, l, Cvae]
            h = model.embed_inputs(x, begin)  # [R, l, C]
        logits = model.forward_cached(h, cond, cache, si)  # [R, l, V]
        if guided:
            logits = cfg_combine(*split_cfg_batch(logits), guidance[si])  # [B, l, V]
        codes, _ = sample_logits(logits, params[si], generator)  # [B, l]
        if state.f_hat is None:
            full = quantizer.patch_nums[-1]
            state.f_hat = logits.new_zeros(b, quantizer.cvae, full, full)
        state.f_hat, state.next_input = quantizer.next_input(si, state.f_hat, codes)
        state.pyramid.append(codes)
        if on_scale is not None:
            on_scale(si, state)
    return state


class VARPipeline(DiffusionPipeline):
    """A VAR transformer and its multi-scale VQVAE (see the module docstring)."""

    model_cpu_offload_seq = "transformer->vqvae"

    def __init__(self, transformer: VARTransformer, vqvae: VARVQVAE) -> None:
        super().__init__()
        check(tuple(transformer.config.patch_nums) == tuple(vqvae.config.patch_nums),
              f"the transformer's patch_nums {tuple(transformer.config.patch_nums)} differ from the VQVAE's "
              f"{tuple(vqvae.config.patch_nums)}; they must use one scale schedule.")
        check(transformer.config.vocab_size == vqvae.config.vocab_size,
              "the transformer's vocabulary differs from the VQVAE's codebook size.")
        self.register_modules(transformer=transformer, vqvae=vqvae)

    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None, guidance_scale: float = 4.0,
                 temperature: float | Sequence[float] = 1.0, top_k: int = 0, top_p: float = 1.0,
                 num_images_per_prompt: int = 1, generator: torch.Generator | list[torch.Generator] | None = None,
                 output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None):
        """Generate images. guidance_scale: the official cfg (0 = no unconditional half); temperature: one
        number or one per scale (0 = greedy); top_k 0 / top_p 1.0 disable the filters; generator: one, or one
        per image. callback_on_step_end(pipe, scale, num_tokens, {"tokens": [N, tokens so far]}) after each
        scale."""
        check_output_type(output_type)
        check(isinstance(guidance_scale, (int, float)) and guidance_scale >= 0,
              f"guidance_scale must be a number >= 0, got {guidance_scale!r}.")
        model, quantizer = self.transformer, self.vqvae.quantize
        n_scales = len(model.patch_nums)
        params = [SamplingParams(t, top_k, top_p) for t in per_scale(temperature, n_scales, "temperature")]
        labels = check_labels(class_labels, num_images_per_prompt, model.config.num_classes, model.device, generator)
        b = labels.shape[0]
        guided = guidance_scale > 0
        cache = model.new_cache(2 * b if guided else b, device=labels.device)

        with self.progress_bar(total=n_scales) as bar:
            def on_scale(si: int, state: ScaleState) -> None:
                bar.update(1)
                if callback_on_step_end is not None:
                    callback_on_step_end(self, si, model.bounds[si][1], {"tokens": torch.cat(state.pyramid, 1)})

            state = generate_scales(model, quantizer, labels, ScaleState(), cache, range(n_scales),
                                    guidance_schedule(guidance_scale, n_scales), params, generator, guided, on_scale)
        tokens = torch.cat(state.pyramid, 1)  # [N, L]
        images = tokens if output_type == "latent" else format_images((self.vqvae.fhat_to_images(state.f_hat) + 1) / 2,
                                                                       output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return images, tokens
        return VARPipelineOutput(images=images, tokens=tokens, num_forwards=n_scales)
