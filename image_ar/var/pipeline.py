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
scales 0..N-1 with one model and the rest with another; `prepare_run`, `scale_progress` and `finish_run` are
the rest of a call, shared by both pipelines, in the shape every image pipeline has (`mmspec.pipeline_io`): the
output is a `GenerationOutput` (images, tokens, stats: the large model's forwards as target forwards, the small
one's, its hand-over prefill included, as draft forwards) plus CoDe's split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import DiffusionPipeline

from image_ar.var.quantizer import MultiScaleQuantizer
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE
from mmspec.cache import StaticKVCache
from mmspec.diffusers_folder import MMSpecPipelineMixin
from mmspec.errors import check
from mmspec.pipeline_io import (
    ClassRun,
    GenerationOutput,
    check_no_inference_steps,
    class_run_fields,
    finish_generation,
)
from mmspec.sampling import Generators, SamplingParams, cfg_combine, sample_logits, split_cfg_batch
from mmspec.stats import SpecStats


@dataclass
class VARPipelineOutput(GenerationOutput):
    """A `GenerationOutput` (tokens [N, L]: the codes of every scale, concatenated) and CoDe's split (None for
    vanilla)."""

    draft_steps: int | None = None


@dataclass
class ScaleState:
    """Where a batch of B images stands: the codes sampled so far (one [B, pn^2] tensor per scale), the running
    f_hat [B, Cvae, H, W], the next scale's input [B, pn^2, Cvae] (None before scale 1 / after the last), and
    whether the user's callback stopped the run."""

    pyramid: list[torch.Tensor] = field(default_factory=list)
    f_hat: torch.Tensor | None = None
    next_input: torch.Tensor | None = None
    stopped: bool = False


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


def check_fits_vqvae(name: str, model: VARTransformer, vqvae: VARVQVAE) -> None:
    """A pipeline's transformer must use its VQVAE's scale schedule and codebook."""
    check(tuple(model.config.patch_nums) == tuple(vqvae.config.patch_nums),
          f"the {name}'s patch_nums {tuple(model.config.patch_nums)} differ from the VQVAE's "
          f"{tuple(vqvae.config.patch_nums)}; they must use one scale schedule.")
    check(model.config.vocab_size == vqvae.config.vocab_size,
          f"the {name}'s vocabulary differs from the VQVAE's codebook size.")


@dataclass
class ScaleRun(ClassRun):
    """A call's class inputs (`ClassRun`) and its per-scale sampling parameters and guidance scales."""

    params: list[SamplingParams] = field(default_factory=list)
    guidance: list[float] = field(default_factory=list)


def prepare_run(model: VARTransformer, class_labels: Any, guidance_scale: float, temperature: float | Sequence[float],
                top_k: int, top_p: float, num_images_per_prompt: int, generator: Generators,
                output_type: str) -> ScaleRun:
    """Check a call's arguments (clear errors) and resolve them per scale."""
    check(isinstance(guidance_scale, (int, float)) and guidance_scale >= 0,
          f"guidance_scale must be a number >= 0, got {guidance_scale!r}.")
    n_scales = len(model.patch_nums)
    fields = class_run_fields(class_labels, num_images_per_prompt, model.config.num_classes, generator, output_type,
                              guided=guidance_scale > 0, device=model.device)
    params = [SamplingParams(t, top_k, top_p) for t in per_scale(temperature, n_scales, "temperature")]
    return ScaleRun(**fields, params=params, guidance=guidance_schedule(guidance_scale, n_scales))


def forward_stats(num_scales: int, draft_steps: int | None) -> SpecStats:
    """Large-model forwards as target forwards, small-model forwards (hand-over prefill included) as draft ones."""
    n = num_scales if draft_steps is None else min(draft_steps, num_scales)  # num_scales: those made (a stopped run)
    small = (num_scales - n) + (1 if 0 < n < num_scales else 0)
    return SpecStats(num_target_forwards=n, num_draft_forwards=small)


def scale_progress(bar: Any, model: VARTransformer,
                   user_step: Callable[[int, int, dict], bool]) -> Callable[[int, ScaleState], bool]:
    """The per-scale hook of a pipeline call: advance the progress bar, then the user's callback
    (`MMSpecPipelineMixin.step_callback`); False stops the call after this scale."""

    def on_scale(si: int, state: ScaleState) -> bool:
        bar.update(1)
        return user_step(si, model.bounds[si][1], {"tokens": torch.cat(state.pyramid, 1)})

    return on_scale


def finish_run(pipe: DiffusionPipeline, vqvae: VARVQVAE, state: ScaleState, output_type: str, return_dict: bool,
               draft_steps: int | None = None):
    """Decode the final f_hat into the requested output (tokens only for "latent"), with the forward counts."""
    tokens = torch.cat(state.pyramid, 1)  # [N, L]
    stats = forward_stats(len(state.pyramid), draft_steps)
    return finish_generation(pipe, tokens, lambda: (vqvae.fhat_to_images(state.f_hat) + 1) / 2, output_type,
                             return_dict, stats, VARPipelineOutput, draft_steps=draft_steps)


def generate_scales(model: VARTransformer, quantizer: MultiScaleQuantizer, run: ScaleRun, state: ScaleState,
                    cache: StaticKVCache, scales: range, generator: Generators = None,
                    on_scale: Callable[[int, ScaleState], bool] | None = None) -> ScaleState:
    """Sample the scales in `scales` (consecutive, continuing `state`) for run.labels [B]; the cache holds the
    run's rows (2B: conditional, then null class, with CFG). `on_scale` returning False stops after that scale
    (`state.stopped`)."""
    b, guided = run.labels.shape[0], run.guided
    cond = model.condition(run.rows)  # [R, C]
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
            logits = cfg_combine(*split_cfg_batch(logits), run.guidance[si])  # [B, l, V]
        codes, _ = sample_logits(logits, run.params[si], generator)  # [B, l]
        if state.f_hat is None:
            full = quantizer.patch_nums[-1]
            state.f_hat = logits.new_zeros(b, quantizer.cvae, full, full)
        state.f_hat, state.next_input = quantizer.next_input(si, state.f_hat, codes)
        state.pyramid.append(codes)
        if on_scale is not None and not on_scale(si, state):
            state.stopped = True
            break
    return state


class VARPipeline(MMSpecPipelineMixin, DiffusionPipeline):
    """A VAR transformer and its multi-scale VQVAE (see the module docstring)."""

    model_cpu_offload_seq = "transformer->vqvae"

    def __init__(self, transformer: VARTransformer, vqvae: VARVQVAE) -> None:
        super().__init__()
        check_fits_vqvae("transformer", transformer, vqvae)
        self.register_modules(transformer=transformer, vqvae=vqvae)

    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None, guidance_scale: float = 4.0,
                 temperature: float | Sequence[float] = 1.0, top_k: int = 0, top_p: float = 1.0,
                 num_images_per_prompt: int = 1, generator: torch.Generator | list[torch.Generator] | None = None,
                 output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None,
                 num_inference_steps: int | None = None):
        """Generate images. guidance_scale: the official cfg (0 = no unconditional half); temperature: one
        number or one per scale (0 = greedy); top_k 0 / top_p 1.0 disable the filters; generator: one, or one
        per image. callback_on_step_end(pipe, scale, num_tokens, {"tokens": [N, tokens so far]}) after each
        scale (`callback_on_step_end_tensor_inputs`: ["tokens"], the one tensor passed; a function or a diffusers
        `PipelineCallback`); `pipe._interrupt = True` stops after the current scale and decodes the partial f_hat.
        return_dict=False returns `(images,)`. num_inference_steps (diffusers' name) is refused: one step per scale."""
        model = self.transformer
        check_no_inference_steps(num_inference_steps, f"it makes one step per scale, so its {len(model.patch_nums)} "
                                                      "steps are fixed by the model's scales (patch_nums).")
        user_step = self.step_callback(callback_on_step_end, callback_on_step_end_tensor_inputs, len(model.patch_nums))
        run = prepare_run(model, class_labels, guidance_scale, temperature, top_k, top_p, num_images_per_prompt,
                          generator, output_type)
        cache = model.new_cache(run.rows.shape[0], device=run.labels.device)
        with self.progress_bar(total=len(model.patch_nums)) as bar:
            state = generate_scales(model, self.vqvae.quantize, run, ScaleState(), cache, range(len(model.patch_nums)),
                                    generator, scale_progress(bar, model, user_step))
        return finish_run(self, self.vqvae, state, output_type, return_dict)
