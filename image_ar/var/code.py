"""`CoDePipeline`: collaborative decoding for VAR (CoDe). A LARGE drafter generates the first `draft_steps` scales
(low-frequency structure), a SMALL refiner generates the rest (high-frequency detail).

Facts: CoDe (arXiv 2411.17787; czg1225/CoDe `models/var.py`). The hand-over is not the KV cache: the refiner re-encodes
the drafted prefix (the class token map and the next-scale inputs of every drafted scale) in ONE block-causal prefill
pass, then continues with its own cache; the drafter's cache is freed at the hand-over, which is where the memory saving
comes from. Default split N = 8 of the official 10 scales (the large model up to 10x10, 255 tokens); for other schedules
the default is S - 2 (the refiner makes the last two scales). Training-free mode = two independently trained models
sharing one VQVAE.

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
    ScaleRun,
    ScaleState,
    VARPipeline,
    check_fits_vqvae,
    finish_run,
    generate_scales,
    prepare_run,
    scale_progress,
)
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE
from mmspec.diffusers_folder import MMSpecPipelineMixin
from mmspec.errors import check
from mmspec.pipeline_io import check_no_inference_steps


def default_draft_steps(num_scales: int) -> int:
    return 8 if num_scales == 10 else max(num_scales - 2, 1)


def refiner_prefill(refiner: VARTransformer, quantizer, run: ScaleRun, state: ScaleState, num_drafted: int):
    """Re-encode the drafted scales 0..N-1 with the refiner in one block-causal pass; returns its cache (the
    run's rows, 2B with CFG), ready for scale N. The logits of the pass are not used (those scales are sampled)."""
    cond = refiner.condition(run.rows)  # [R, C]
    inputs = quantizer.scale_inputs(state.pyramid, num_drafted)  # [B, l, Cvae] of scales 1..N-1
    if run.guided:
        inputs = inputs.repeat(2, 1, 1)
    h = torch.cat([refiner.first_token_map(cond), refiner.embed_inputs(inputs, refiner.first_l)], 1)
    cache = refiner.new_cache(run.rows.shape[0], device=run.labels.device)
    refiner.forward_cached(h, cond, cache, 0)
    return cache


class CoDePipeline(MMSpecPipelineMixin, DiffusionPipeline):
    """A large `drafter` and a small `refiner` VAR transformer sharing one VQVAE (see the module docstring)."""

    model_cpu_offload_seq = "drafter->refiner->vqvae"

    def __init__(self, drafter: VARTransformer, refiner: VARTransformer, vqvae: VARVQVAE) -> None:
        super().__init__()
        check_fits_vqvae("drafter", drafter, vqvae)
        check_fits_vqvae("refiner", refiner, vqvae)
        check(drafter.config.num_classes == refiner.config.num_classes,
              "the drafter and the refiner must have the same classes.")
        self.register_modules(drafter=drafter, refiner=refiner, vqvae=vqvae)

    def as_var_pipeline(self, which: str = "drafter") -> VARPipeline:
        """One of the two models alone as a vanilla `VARPipeline` (shares the modules, copies nothing):
        "drafter" is the large model alone, CoDe's baseline."""
        check(which in ("drafter", "refiner"), f"which must be 'drafter' or 'refiner', got {which!r}.")
        pipe = VARPipeline(transformer=getattr(self, which), vqvae=self.vqvae)
        pipe.set_progress_bar_config(**getattr(self, "_progress_bar_config", {}))
        return pipe

    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None, draft_steps: int | None = None,
                 guidance_scale: float = 4.0, temperature: float | Sequence[float] = 1.0, top_k: int = 0,
                 top_p: float = 1.0, num_images_per_prompt: int = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "pil",
                 return_dict: bool = True, callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None,
                 num_inference_steps: int | None = None):
        """As `VARPipeline.__call__`, plus draft_steps N: the drafter makes scales 0..N-1, the refiner the rest."""
        n_scales = len(self.drafter.patch_nums)
        check_no_inference_steps(num_inference_steps, f"it makes one step per scale, so its {n_scales} steps are "
                                                      "fixed by the models' scales (patch_nums); draft_steps sets how "
                                                      "many the drafter makes.")
        user_step = self.step_callback(callback_on_step_end, callback_on_step_end_tensor_inputs, n_scales)
        n = default_draft_steps(n_scales) if draft_steps is None else draft_steps
        check(isinstance(n, int) and 0 <= n <= n_scales, f"draft_steps must be an integer in [0, {n_scales}], got "
                                                         f"{draft_steps!r}.")
        run = prepare_run(self.drafter, class_labels, guidance_scale, temperature, top_k, top_p,
                          num_images_per_prompt, generator, output_type)
        quantizer, state = self.vqvae.quantize, ScaleState()
        with self.progress_bar(total=n_scales) as bar:
            on_scale = scale_progress(bar, self.drafter, user_step)
            if n > 0:
                cache = self.drafter.new_cache(run.rows.shape[0], device=run.labels.device, num_scales=n)
                generate_scales(self.drafter, quantizer, run, state, cache, range(n), generator, on_scale)
                del cache  # the hand-over frees the drafter's KV cache
            if n < n_scales and not state.stopped:
                cache = (refiner_prefill(self.refiner, quantizer, run, state, n) if n > 0
                         else self.refiner.new_cache(run.rows.shape[0], device=run.labels.device))
                generate_scales(self.refiner, quantizer, run, state, cache, range(n, n_scales), generator, on_scale)
        return finish_run(self, self.vqvae, state, output_type, return_dict, n)  # stats count the hand-over prefill
