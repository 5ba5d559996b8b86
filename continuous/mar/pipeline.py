"""`MARPipeline`: vanilla MAR generation (a diffusers `DiffusionPipeline`), and the pieces CSpD shares with it.

    pipe = MARPipeline(transformer=MARModel(...), vae=AutoencoderKL(...))
    out = pipe(class_labels=[3, 7], num_iter=64, guidance_scale=3.0, generator=gens)
    out.images, out.tokens     # images; the generated latent tokens [N, L, C]

As the official `sample_tokens`: every image gets a random generation order; after step k, floor(L cos(pi/2 (k+1)
/ num_iter)) tokens stay masked (at least one new token per step, all remaining at the last step); the decoder's
outputs at the step's positions condition the diffusion head, which denoises them with CFG on eps (linear schedule
cfg_k = 1 + (cfg - 1) (L - masked after step k) / L, or constant) and temperature on the per-step noise.

Randomness (`draw_randomness`): each image's order and the noise of every position (x_T and every diffusion step)
are drawn up front from the image's generator, keyed by position. So an image does not depend on its batch, and
CSpD's draft and target see the same noise for a position (trajectory alignment) as vanilla MAR would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKL, DiffusionPipeline

from continuous.mar.diffusion import Trajectory
from continuous.mar.model import CFG_SCHEDULES, MARModel
from continuous.mar.vae import decode_latents, vae_stride
from mmspec.diffusers_folder import MMSpecPipelineMixin
from mmspec.errors import check, check_positive_int
from mmspec.pipeline_io import ClassRun, GenerationOutput, class_run_fields, finish_generation
from mmspec.sampling import Generators, generator_list
from mmspec.stats import SpecStats

MARPipelineOutput = GenerationOutput  # images, tokens [N, L, C], stats (CSpD's, or the target's forwards)


@dataclass
class MARRun(ClassRun):
    """A call's class inputs (`ClassRun`), its sampling settings and its randomness: orders [B, L], x_T [B, L, C],
    step noise [B, L, S, C]."""

    guidance_scale: float = 1.0
    cfg_schedule: str = "linear"
    temperature: float = 1.0
    num_sampling_steps: int = 100
    orders: torch.Tensor | None = None
    x_start: torch.Tensor | None = None
    step_noise: torch.Tensor | None = None


def masked_after(step: int, num_iter: int, seq_len: int, remaining: int) -> int:
    """Tokens still masked after `step` when `remaining` are masked before it (official schedule, incl. its
    clamp to >= 1, which only the CFG schedule sees at the last step)."""
    return max(1, min(remaining - 1, math.floor(seq_len * math.cos(math.pi / 2 * (step + 1) / num_iter))))


def step_sizes(num_iter: int, seq_len: int) -> list[tuple[int, int]]:
    """[(tokens predicted, tokens masked after, as the CFG schedule reads it)] of every step."""
    sizes, remaining = [], seq_len
    for step in range(num_iter):
        after = masked_after(step, num_iter, seq_len, remaining)
        count = remaining if step == num_iter - 1 else remaining - after
        sizes.append((count, after))
        remaining -= count
    return sizes


def cfg_value(run: MARRun, masked: torch.Tensor | int, seq_len: int) -> torch.Tensor | float:
    """The CFG scale with `masked` tokens left after the token(s) being sampled (a number or a tensor)."""
    if run.cfg_schedule == "constant":
        return run.guidance_scale
    return 1 + (run.guidance_scale - 1) * (seq_len - masked) / seq_len


def draw_randomness(generator: Generators, batch: int, seq_len: int, steps: int, channels: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """orders [B, L], x_T [B, L, C] and step noise [B, L, S, C]; row b from generator b when a list is given. A single
    generator (or None: torch's global one) draws the rows as a list holding it B times would (every order, then
    every row's noise), so `generator=g` and `generator=[g]` give a batch of one the same numbers."""
    gens = generator_list(generator, batch) or [generator] * batch
    orders = torch.stack([torch.randperm(seq_len, generator=g) for g in gens])
    noise = torch.stack([torch.randn(seq_len, steps + 1, channels, generator=g) for g in gens])
    noise = noise.to(device)
    return orders.to(device), noise[:, :, 0], noise[:, :, 1:]


def prepare_run(model: MARModel, class_labels: Any, guidance_scale: float | None, cfg_schedule: str | None,
                temperature: float, num_sampling_steps: int, num_images_per_prompt: int, generator: Generators,
                output_type: str) -> MARRun:
    """Check a call's arguments (clear errors) and draw its randomness. guidance_scale / cfg_schedule None: the
    model's `default_guidance_scale` / `default_cfg_schedule`."""
    guidance_scale = model.config.default_guidance_scale if guidance_scale is None else guidance_scale
    cfg_schedule = model.config.default_cfg_schedule if cfg_schedule is None else cfg_schedule
    check(isinstance(guidance_scale, (int, float)) and guidance_scale >= 1.0,
          f"guidance_scale must be a number >= 1.0 (1.0 = no guidance, MAR's convention), got {guidance_scale!r}.")
    check(cfg_schedule in CFG_SCHEDULES, f"cfg_schedule must be one of {CFG_SCHEDULES}, got {cfg_schedule!r}.")
    check(isinstance(temperature, (int, float)) and temperature >= 0, f"temperature must be >= 0, got {temperature!r}.")
    check_positive_int("num_sampling_steps", num_sampling_steps)
    fields = class_run_fields(class_labels, num_images_per_prompt, model.config.num_classes, generator, output_type,
                              guided=guidance_scale != 1.0, device=model.device)
    orders, x_start, step_noise = draw_randomness(generator, fields["labels"].shape[0], model.seq_len,
                                                  num_sampling_steps, model.token_channels, model.device)
    return MARRun(**fields, guidance_scale=float(guidance_scale), cfg_schedule=cfg_schedule,
                  temperature=float(temperature), num_sampling_steps=num_sampling_steps, orders=orders,
                  x_start=x_start.to(model.dtype), step_noise=step_noise.to(model.dtype))


def gather_positions(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values [B, L, ...] at positions [B, n] -> [B, n, ...]."""
    index = positions.reshape(*positions.shape, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:])
    return values.gather(1, index)


def sample_at(model: MARModel, run: MARRun, tokens: torch.Tensor, known: torch.Tensor, positions: torch.Tensor,
              cfg: torch.Tensor | float, noise_from: MARRun | None = None) -> Trajectory:
    """One MAR forward (both CFG halves) and the diffusion head at positions [B, n]: the trajectory of the B x n
    tokens (flattened row-major). cfg: a number or [B, n] per token; noise_from: take x_T and the step noise from
    another run's draws (default this run's)."""
    noise = noise_from or run
    rows = run.rows.shape[0]
    repeat = rows // tokens.shape[0]
    z = model.predict(tokens.repeat(repeat, 1, 1), known.repeat(repeat, 1), model.condition(run.rows))  # [R, L, D]
    z = gather_positions(z, positions.repeat(repeat, 1)).flatten(0, 1)  # [R n, D]
    x_t = gather_positions(noise.x_start, positions).flatten(0, 1)  # [B n, C]
    step_noise = gather_positions(noise.step_noise, positions).flatten(0, 1).transpose(0, 1)  # [S, B n, C]
    if isinstance(cfg, torch.Tensor):
        cfg = cfg.reshape(-1, 1).to(x_t.dtype)
    return model.diffloss.sample(z, x_t, step_noise, cfg=cfg, temperature=run.temperature,
                                 num_sampling_steps=run.num_sampling_steps, guided=run.guided,
                                 timestep_spacing=model.config.timestep_spacing)


def scatter_tokens(tokens: torch.Tensor, known: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit values [B, n, C] at positions [B, n] (where keep [B, n], or all) and mark them known. Entries not kept
    go to a scratch slot past the end, so repeated positions (a window padded past the last token) cannot clash."""
    b, seq, c = tokens.shape
    if keep is None:
        return (tokens.scatter(1, positions.unsqueeze(-1).expand(-1, -1, c), values.to(tokens.dtype)),
                known.scatter(1, positions, True))
    target = torch.where(keep, positions, seq)  # [B, n]
    tokens = torch.cat([tokens, tokens.new_zeros(b, 1, c)], 1).scatter(
        1, target.unsqueeze(-1).expand(-1, -1, c), values.to(tokens.dtype))[:, :seq]
    known = torch.cat([known, known.new_zeros(b, 1)], 1).scatter(1, target, True)[:, :seq]
    return tokens, known


def finish_run(pipe: DiffusionPipeline, model: MARModel, vae: AutoencoderKL, tokens: torch.Tensor, output_type: str,
               return_dict: bool, stats: SpecStats):
    """Decode the tokens into the requested output (tokens only for "latent")."""
    return finish_generation(pipe, tokens, lambda: (decode_latents(vae, model.unpatchify(tokens)) + 1) / 2,
                             output_type, return_dict, stats)


def check_fits_vae(name: str, model: MARModel, vae: AutoencoderKL) -> None:
    """A MAR's token grid must be the VAE's latent grid."""
    check(model.config.vae_embed_dim == vae.config.latent_channels,
          f"the {name}'s vae_embed_dim {model.config.vae_embed_dim} differs from the VAE's latent channels "
          f"{vae.config.latent_channels}.")
    check(model.config.vae_stride == vae_stride(vae),
          f"the {name}'s vae_stride {model.config.vae_stride} differs from the VAE's downsampling {vae_stride(vae)}.")


def inference_steps(num_sampling_steps: int, num_inference_steps: int | None) -> int:
    """diffusers' `num_inference_steps` (a diffusion sampler's step count) as MAR's `num_sampling_steps` (the name the
    MAR code uses for its diffusion head's steps); both given must agree."""
    if num_inference_steps is None:
        return num_sampling_steps
    check(num_sampling_steps in (100, num_inference_steps),
          f"num_inference_steps={num_inference_steps} and num_sampling_steps={num_sampling_steps} disagree; pass one.")
    return num_inference_steps


class MARPipeline(MMSpecPipelineMixin, DiffusionPipeline):
    """A MAR model (`transformer`) and its KL VAE (see the module docstring)."""

    model_cpu_offload_seq = "transformer->vae"

    def __init__(self, transformer: MARModel, vae: AutoencoderKL) -> None:
        super().__init__()
        check_fits_vae("transformer", transformer, vae)
        self.register_modules(transformer=transformer, vae=vae)

    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None, num_iter: int | None = None,
                 num_sampling_steps: int = 100, guidance_scale: float | None = None, cfg_schedule: str | None = None,
                 temperature: float = 1.0, num_images_per_prompt: int = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "pil",
                 return_dict: bool = True, callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None,
                 num_inference_steps: int | None = None):
        """Generate images. num_iter: MAR steps (default the token count: one token per step); guidance_scale:
        MAR's cfg (1.0 = no unconditional half) and cfg_schedule ("linear" or "constant"), None = the model's
        `default_guidance_scale` / `default_cfg_schedule`; temperature scales the diffusion noise; generator: one,
        or one per image. callback_on_step_end(pipe, step, tokens generated, {"tokens": [N, L, C]}) after each step
        (`callback_on_step_end_tensor_inputs`: ["tokens"]). A callback may be a diffusers `PipelineCallback`;
        `pipe._interrupt = True` stops after the current step and decodes the tokens made so far (the rest zero).
        return_dict=False returns `(images,)`. num_inference_steps: diffusers' name for num_sampling_steps (the
        diffusion head's steps per token)."""
        num_sampling_steps = inference_steps(num_sampling_steps, num_inference_steps)
        model = self.transformer
        seq = model.seq_len
        num_iter = seq if num_iter is None else num_iter
        check(isinstance(num_iter, int) and 1 <= num_iter <= seq,
              f"num_iter must be an integer in [1, {seq}] (the token count), got {num_iter!r}.")
        user_step = self.step_callback(callback_on_step_end, callback_on_step_end_tensor_inputs, num_iter)
        run = prepare_run(model, class_labels, guidance_scale, cfg_schedule, temperature, num_sampling_steps,
                          num_images_per_prompt, generator, output_type)
        b = run.labels.shape[0]
        tokens = torch.zeros(b, seq, model.token_channels, device=model.device, dtype=model.dtype)
        known = torch.zeros(b, seq, dtype=torch.bool, device=model.device)
        done = 0
        with self.progress_bar(total=num_iter) as bar:
            for step, (count, after) in enumerate(step_sizes(num_iter, seq)):
                positions = run.orders[:, done:done + count]  # [B, n]
                traj = sample_at(model, run, tokens, known, positions, cfg_value(run, after, seq))
                tokens, known = scatter_tokens(tokens, known, positions, traj.x0.reshape(b, count, -1))
                done += count
                bar.update(1)
                if not user_step(step, done, {"tokens": tokens}):
                    break
        return finish_run(self, model, self.vae, tokens, output_type, return_dict,
                          SpecStats(num_target_forwards=step + 1))
