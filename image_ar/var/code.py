"""`CoDePipeline`: collaborative decoding for VAR (CoDe). A LARGE drafter generates the first `draft_steps` scales
(low-frequency structure), a SMALL refiner generates the rest (high-frequency detail).

Facts from ../shared/reference/image_ar.md (CoDe). The hand-over is not the KV cache: the refiner re-encodes the
drafted prefix (the class token map and the next-scale inputs of every drafted scale) in ONE block-causal prefill
pass, then continues with its own cache; the drafter's cache is freed at the hand-over, which is where the memory
saving comes from. Default split N = 8 of the official 10 scales (the large model up to 10x10, 255 tokens); for
other schedules the default is S - 2 (the refiner makes the last two scales). Training-free mode = two
independently trained models sharing one VQVAE.

    pipe = CoDePipeline(drafter=large, refiner=small, vqvae=vqvae)
    out = pipe(class_labels=[3, 7], draft_steps=8, guidance_scale=4.0, top_k=600, top_p=0.95, generator=gens)

`draft_steps` may be 0 (the refiner alone) to S (the drafter alone), for a table over every split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers import DiffusionPipeline

from image_ar.var.pipeline import (
    ScaleState,
    VARPipelineOutput,
    check_labels,
    generate_scales,
    guidance_schedule,
    per_scale,
)
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE
from mmspec.errors import check
from mmspec.images import check_output_type, format_images
from mmspec.sampling import SamplingParams


def default_draft_steps(num_scales: int) -> int:
    return 8 if num_scales == 10 else max(num_scales - 2, 1)


def refiner_prefill(refiner: VARTransformer, quantizer, labels: torch.Tensor, state: ScaleState,
                    num_drafted: int, guided: bool):
    """Re-encode the drafted scales 0..N-1 with the refiner in one block-causal pass; returns its cache (2B rows
    with CFG), ready for scale N. The logits of the pass are not used (those scales are already sampled)."""
    rows = torch.cat([labels, torch.full_like(labels, refiner.config.num_classes)]) if guided else labels
    cond = refiner.condition(rows)  # [R, C]
    inputs = quantizer.scale_inputs(state.pyramid, num_drafted)  # [B, l, Cvae] of scales 1..N-1
    if guided:
        inputs = inputs.repeat(2, 1, 1)
    h = torch.cat([refiner.first_token_map(cond), refiner.embed_inputs(inputs, refiner.first_l)], 1)
    cache = refiner.new_cache(rows.shape[0], device=labels.device)
    refiner.forward_cached(h, cond, cache, 0)
    return cache


class CoDePipeline(DiffusionPipeline):
    """A large `drafter` and a small `refiner` VAR transformer sharing one VQVAE (see the module docstring)."""

    model_cpu_offload_seq = "drafter->refiner->vqvae"

    def __init__(self, drafter: VARTransformer, refiner: VARTransformer, vqvae: VARVQVAE) -> None:
        super().__init__()
        for name, model in (("drafter", drafter), ("refiner", refiner)):
            check(tuple(model.config.patch_nums) == tuple(vqvae.config.patch_nums),
                  f"the {name}'s patch_nums {tuple(model.config.patch_nums)} differ from the VQVAE's "
                  f"{tuple(vqvae.config.patch_nums)}; the models must share the VQVAE's scale schedule.")
            check(model.config.vocab_size == vqvae.config.vocab_size,
                  f"the {name}'s vocabulary differs from the VQVAE's codebook size.")
        check(drafter.config.num_classes == refiner.config.num_classes,
              "the drafter and the refiner must have the same classes.")
        self.register_modules(drafter=drafter, refiner=refiner, vqvae=vqvae)

    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None, draft_steps: int | None = None,
                 guidance_scale: float = 4.0, temperature: float | Sequence[float] = 1.0, top_k: int = 0,
                 top_p: float = 1.0, num_images_per_prompt: int = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "pil",
                 return_dict: bool = True, callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None):
        """As `VARPipeline.__call__`, plus draft_steps N: the drafter makes scales 0..N-1, the refiner the rest."""
        check_output_type(output_type)
        check(isinstance(guidance_scale, (int, float)) and guidance_scale >= 0,
              f"guidance_scale must be a number >= 0, got {guidance_scale!r}.")
        n_scales = len(self.drafter.patch_nums)
        n = default_draft_steps(n_scales) if draft_steps is None else draft_steps
        check(isinstance(n, int) and 0 <= n <= n_scales, f"draft_steps must be an integer in [0, {n_scales}], got "
                                                         f"{draft_steps!r}.")
        params = [SamplingParams(t, top_k, top_p) for t in per_scale(temperature, n_scales, "temperature")]
        labels = check_labels(class_labels, num_images_per_prompt, self.drafter.config.num_classes,
                              self.drafter.device, generator)
        guided = guidance_scale > 0
        rows = 2 * labels.shape[0] if guided else labels.shape[0]
        schedule = guidance_schedule(guidance_scale, n_scales)
        quantizer, state = self.vqvae.quantize, ScaleState()

        with self.progress_bar(total=n_scales) as bar:
            def on_scale(si: int, st: ScaleState) -> None:
                bar.update(1)
                if callback_on_step_end is not None:
                    callback_on_step_end(self, si, self.drafter.bounds[si][1], {"tokens": torch.cat(st.pyramid, 1)})

            if n > 0:
                cache = self.drafter.new_cache(rows, device=labels.device)
                generate_scales(self.drafter, quantizer, labels, state, cache, range(n), schedule, params, generator,
                                guided, on_scale)
                del cache  # the hand-over frees the drafter's KV cache
            if n < n_scales:
                cache = (refiner_prefill(self.refiner, quantizer, labels, state, n, guided) if n > 0
                         else self.refiner.new_cache(rows, device=labels.device))
                generate_scales(self.refiner, quantizer, labels, state, cache, range(n, n_scales), schedule, params,
                                generator, guided, on_scale)
        tokens = torch.cat(state.pyramid, 1)  # [N, L]
        images = tokens if output_type == "latent" else format_images((self.vqvae.fhat_to_images(state.f_hat) + 1) / 2,
                                                                       output_type)
        self.maybe_free_model_hooks()
        forwards = n + (n_scales - n) + (1 if 0 < n < n_scales else 0)  # the refiner's prefill is one forward
        if not return_dict:
            return images, tokens
        return VARPipelineOutput(images=images, tokens=tokens, num_forwards=forwards)
