"""`CSpDPipeline`: continuous speculative decoding for MAR (a diffusers `DiffusionPipeline`): a draft MAR proposes a
window of gamma tokens, one per step along the image's order, and the target verifies the window in ONE pass.

    pipe = CSpDPipeline(target=MARModel(...), draft=MARModel(...), vae=AutoencoderKL(...))
    out = pipe(class_labels=[3, 7], gamma=8, prefill_ratio=0.05, generator=gens)
    out.images, out.stats.draft_acceptance_rate, out.stats.extra["residual_fallbacks"]

The loop (`cspd_loop`, per batch, rows ragged; its phases are timed like the discrete loop's, `mmspec.phases`):
the target alone makes the first ceil(prefill_ratio x L) tokens (one per step, "pre-filling"); then, while a row has
tokens left:
1. draft: gamma MAR forwards; forward k sees the row's verified tokens and its own window tokens 0..k-1 and samples
   window token k (the next position in the row's order) with the diffusion head;
2. verify: ONE target forward whose encoder sees the tokens verified before the window and whose decoder predicts
   every window position: window token k is conditioned on the verified prefix only, not on window tokens 0..k-1
   (the paper's one-pass verification; this is why the rule is an approximation). The target's head denoises
   all window tokens at once;
3. accept (`mmspec.verify.cspd.CSpDRule`): the first rejected token is replaced by a residual sample, the rest of
   the window is discarded.
Both heads use the noise that vanilla MAR draws for the position (trajectory alignment, `align=True`); with
`align=False` the draft uses noise of its own (the paper's ablation). The CFG scale of a token is the linear schedule's
value for its place in the order (as vanilla MAR with num_iter = L). `as_mar_pipeline("target")` is vanilla MAR.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from diffusers import AutoencoderKL, DiffusionPipeline

from continuous.mar.diffusion import Trajectory
from continuous.mar.model import MARModel
from continuous.mar.pipeline import (
    MARPipeline,
    MARRun,
    cfg_value,
    check_fits_vae,
    draw_randomness,
    finish_run,
    inference_steps,
    prepare_run,
    sample_at,
    scatter_tokens,
)
from mmspec.budget import BudgetCall, BudgetConfig, ThroughputBudget, budget_config, check_budget_mode
from mmspec.diffusers_folder import MMSpecPipelineMixin
from mmspec.errors import check, check_positive_int
from mmspec.phases import phase
from mmspec.profiling import ForwardTimes, cached_profile, measure_forward_times, profile_key
from mmspec.sampling import Generators
from mmspec.stats import SpecStats
from mmspec.tree import chain
from mmspec.verify import VerifyResult
from mmspec.verify.cspd import ContinuousRandomness, ContinuousVerifyResult, CSpDRule, GaussianPath

log = logging.getLogger("mmspec.budget")


def gaussian_path(traj: Trajectory, batch: int, temperature: float) -> GaussianPath:
    """A window's trajectory ([B K] tokens) as the rule's view: log-variances include the temperature's 2 log t."""
    shift = 2 * math.log(temperature)
    log_var = traj.log_variances + shift  # [S, B K, C]
    return GaussianPath(x0=traj.x0.unflatten(0, (batch, -1)),
                        log_det_steps=log_var[1:].sum((0, 2)).unflatten(0, (batch, -1)),
                        last_mean=traj.last_mean.unflatten(0, (batch, -1)),
                        last_log_variance=log_var[0].unflatten(0, (batch, -1)))


def draft_window(draft: MARModel, run: MARRun, noise: MARRun, tokens: torch.Tensor, known: torch.Tensor,
                 positions: torch.Tensor, cfg: torch.Tensor, in_window: torch.Tensor) -> GaussianPath:
    """gamma draft forwards: forward k sees the verified tokens and window tokens 0..k-1 and samples window token
    k at positions[:, k] ([B, K]) with per-token cfg [B, K]; rows' windows end at in_window [B, K]."""
    paths = []
    for k in range(positions.shape[1]):
        at = slice(k, k + 1)
        traj = sample_at(draft, run, tokens, known, positions[:, at], cfg[:, at], noise_from=noise)
        paths.append(traj)
        tokens, known = scatter_tokens(tokens, known, positions[:, at], traj.x0.unsqueeze(1), in_window[:, at])
    window = Trajectory(torch.stack([t.x0 for t in paths], 1).flatten(0, 1),  # [B K, C]
                        torch.stack([t.log_variances for t in paths], 2).flatten(1, 2),  # [S, B K, C]
                        torch.stack([t.last_mean for t in paths], 1).flatten(0, 1))  # [B K, C]
    return gaussian_path(window, tokens.shape[0], run.temperature)


def verify_window(target: MARModel, run: MARRun, tokens: torch.Tensor, known: torch.Tensor, positions: torch.Tensor,
                  cfg: torch.Tensor) -> GaussianPath:
    """ONE target forward: the encoder sees the verified tokens, the decoder predicts every window position
    [B, K]; the head denoises all window tokens at once (the run's noise: aligned with the draft's)."""
    return gaussian_path(sample_at(target, run, tokens, known, positions, cfg), tokens.shape[0], run.temperature)


# on_progress(tokens verified in every row so far, tokens [B, L, C]) after each pre-filling step and window;
# False ends the loop there (the tokens not yet verified stay zero)
Progress = Callable[[int, torch.Tensor], bool]


def plain_step(target: MARModel, run: MARRun, tokens: torch.Tensor, known: torch.Tensor, done: torch.Tensor,
               active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One target step without drafts: each active row's next token in its order (vanilla MAR with num_iter = L)."""
    seq = target.seq_len
    positions = run.orders.gather(1, done.clamp_max(seq - 1).unsqueeze(1))  # [B, 1]
    cfg = torch.as_tensor(cfg_value(run, (seq - done - 1).clamp_min(1).unsqueeze(1), seq), dtype=run.x_start.dtype,
                          device=done.device).expand(done.shape[0], 1)  # [B, 1]
    traj = sample_at(target, run, tokens, known, positions, cfg)
    return scatter_tokens(tokens, known, positions, traj.x0.unsqueeze(1), active.unsqueeze(1))


def chain_view(result: ContinuousVerifyResult, window: torch.Tensor) -> VerifyResult:
    """A window's verdict as a draft budget reads a chain: a window of w tokens is w - 1 drafts after a token the
    target always gives (accepted, or its residual), and the tokens it emitted beyond that one are the accepted
    drafts (the independent-checks variant emits the whole window)."""
    drafted = (window - 1).clamp_min(0)  # [B]
    accepted = torch.minimum((result.num_emitted - 1).clamp_min(0), drafted)  # [B]
    flags = torch.arange(int(drafted.max().clamp_min(0)), device=window.device) < accepted.unsqueeze(1)  # [B, K]
    return VerifyResult(result.output_tokens, accepted, flags, drafted)


def plain_view(batch: int, device: torch.device) -> VerifyResult:
    """A plain step's verdict for the stats and the budget: no drafts, one token per active row."""
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    return VerifyResult(zeros.unsqueeze(1), zeros, torch.zeros(batch, 0, dtype=torch.bool, device=device), zeros)


def check_window_settings(gamma: Any, prefill_ratio: Any) -> None:
    """CSpD's window size and pre-filled share (no model needed: the MAR family checks them before it loads one)."""
    check_positive_int("gamma", gamma)
    check(isinstance(prefill_ratio, (int, float)) and not isinstance(prefill_ratio, bool) and 0 <= prefill_ratio <= 1,
          f"prefill_ratio must be in [0, 1], got {prefill_ratio!r}.")


def cspd_loop(target: MARModel, draft: MARModel, run: MARRun, draft_noise: MARRun, gamma: int, prefill_ratio: float,
              rule: CSpDRule, generator: Generators = None, on_progress: Progress | None = None,
              budget: ThroughputBudget | None = None) -> tuple[torch.Tensor, SpecStats]:
    """CSpD over one batch (see the module docstring): pre-filling by the target, then draft -> verify -> accept ->
    commit windows of `gamma` tokens until every row has its L tokens. Returns tokens [B, L, C] and the stats
    (target / draft forwards, acceptance per window position; extra: residual_samples, residual_fallbacks).
    budget: picks each step's window (`cspd_budget`: k drafts of a chain = a window of k + 1, 0 = a plain target
    step), and through its call gate may run the whole call as plain steps (`mmspec.budget.BudgetCall`; extra
    `calls_without_drafter`); None = `gamma` every step."""
    seq, channels, device = target.seq_len, target.token_channels, target.device
    b = run.labels.shape[0]
    tokens = torch.zeros(b, seq, channels, device=device, dtype=target.dtype)
    known = torch.zeros(b, seq, dtype=torch.bool, device=device)
    done = torch.zeros(b, dtype=torch.long, device=device)  # [B] tokens verified per row
    stats = SpecStats()
    with phase("prefill"):
        for _ in range(math.ceil(prefill_ratio * seq)):  # the target alone, one token per step
            positions = run.orders[:, done[0]].unsqueeze(1)  # [B, 1] (every row at the same place)
            cfg = cfg_value(run, max(1, seq - int(done[0]) - 1), seq)
            traj = sample_at(target, run, tokens, known, positions, cfg)
            tokens, known = scatter_tokens(tokens, known, positions, traj.x0.unsqueeze(1))
            done += 1
            stats.num_target_forwards += 1
            if on_progress is not None and not on_progress(int(done.min()), tokens):
                return tokens, stats
    steering = BudgetCall(budget, stats)  # the budget's side, as in `mmspec.loop.generate`
    steering.begin(target, draft, None, rule)
    while bool((done < seq).any()):  # the one host sync per window
        active = done < seq
        drafts = steering.choose(b, lambda done=done, active=active: (seq - done) * active)
        size = gamma if drafts is None else drafts + 1  # the window (1 = a plain step under a budget)
        if budget is not None and size == 1:
            with phase("verify"):
                tokens, known = plain_step(target, run, tokens, known, done, active)
            done = done + active.long()
            stats.num_target_forwards += 1
            result = plain_view(b, device)
            steering.observe(0, result, active, None)
            stats.record(result, active)
            if on_progress is not None and not on_progress(int(done.min()), tokens):
                break
            continue
        window = torch.minimum(torch.full_like(done, size), seq - done)  # [B] ragged window sizes
        index = (done.unsqueeze(1) + torch.arange(size, device=device)).clamp_max(seq - 1)  # [B, K]
        positions = run.orders.gather(1, index)  # [B, K] (past the end: repeats, never kept)
        in_window = torch.arange(size, device=device) < window.unsqueeze(1)
        cfg = torch.as_tensor(cfg_value(run, (seq - index - 1).clamp_min(1), seq), dtype=run.x_start.dtype,
                              device=device).expand(b, size)  # [B, K]
        with phase("draft"):
            q = draft_window(draft, run, draft_noise, tokens, known, positions, cfg, in_window)
        stats.num_draft_forwards += size
        with phase("verify"):
            p = verify_window(target, run, tokens, known, positions, cfg)
        stats.num_target_forwards += 1
        with phase("accept"):
            rand = ContinuousRandomness.draw(b, size, rule.max_residual_tries, channels, generator, device)
            result = rule.verify(q, p, window, rand)  # finished rows: window 0
        with phase("commit"):
            keep = torch.arange(size, device=device) < result.num_emitted.unsqueeze(1)  # [B, K]
            tokens, known = scatter_tokens(tokens, known, positions, result.output_tokens.to(tokens.dtype), keep)
            done = done + result.num_emitted
        steering.observe(size - 1, chain_view(result, window), active, None)
        stats.record(result, active)
        stats.add_extra("residual_samples", int(result.residual.sum()))
        stats.add_extra("residual_fallbacks", int(result.fallback.sum()))
        if on_progress is not None and not on_progress(int(done.min()), tokens):
            break
    steering.end()
    return tokens, stats


def cspd_budget(target: MARModel, draft: MARModel, run: MARRun, gamma: int, keep: dict | None = None,
                rule_name: str = "", config: BudgetConfig | None = None) -> ThroughputBudget:
    """The window budget of a call (`mmspec.budget.ThroughputBudget`) over chains of 0..gamma - 1 drafts (a window
    of k + 1 tokens; 0 = a plain target step), from the measured seconds of a target step over n window positions
    and of the draft's one-token steps (k + 1 of them per window; `window_costs`), then each size's own step times.
    Kept in `keep` between calls of the same batch size and settings (acceptance and times carry over)."""
    b = run.labels.shape[0]
    key = ("cspd", gamma, b, run.num_sampling_steps, float(run.temperature), str(run.cfg_schedule),
           float(run.guidance_scale), rule_name, config)
    if keep is not None and key in keep:
        return keep[key]
    verify, draft_step = window_costs(target, draft, run, sorted({w for w in WINDOW_WIDTHS if w <= gamma} | {gamma}))
    costs = [verify.seconds_at(b, k + 1) + ((k + 1) * draft_step if k else 0.0) for k in range(gamma)]
    budget = ThroughputBudget([chain(k) for k in range(gamma)], list(range(gamma)), config, costs=costs)
    if keep is not None:
        keep[key] = budget
    return budget


WINDOW_WIDTHS = (1, 2, 3, 5, 9, 17, 33, 65)  # window widths timed for a budget (interpolated between)


def window_costs(target: MARModel, draft: MARModel, run: MARRun, widths: list[int]) -> tuple[ForwardTimes, float]:
    """(median seconds of a target forward and its head over n window positions, per width; of one draft step) at
    the run's batch size, sampling steps and CFG; measured once, cached (`mmspec.profiling`)."""
    b = run.labels.shape[0]

    def timer(model: MARModel):
        window = window_forward(model, run)
        return lambda batch, width: window(width)

    announced = []

    def measure(model: MARModel, at: list[int]) -> ForwardTimes:  # only when a table is not cached yet
        if not announced:
            announced.append(True)
            log.info("mmspec: timing CSpD windows on this device for budget='auto' (once per model pair, batch size "
                     "and device; cached)")
        return measure_forward_times(timer(model), [b], at, repeats=3, warmup=1, device=target.device)

    extra = f"cspd-window|B={b}|steps={run.num_sampling_steps}|cfg={run.guidance_scale}|canvas=half"
    verify = cached_profile(profile_key(target, target.device, f"{extra}|W={widths}"), lambda: measure(target, widths))
    draft_step = cached_profile(profile_key(draft, target.device, extra), lambda: measure(draft, [1]))
    return verify, draft_step.seconds_at(b, 1)


def window_forward(model: MARModel, run: MARRun) -> Callable[[int], None]:
    """width -> one forward of `model` and its diffusion head over the first `width` positions of the run's orders,
    on a half-known canvas (the later half of the run's order known, the window the first `width` of the order), at
    the run's batch, sampling steps and guidance: what a CSpD window of that width costs the model (nothing is
    kept). Half known, as a generation's canvas is on average: MAR's encoder reads the known tokens, so an empty
    canvas under-reads a step (the world MAR at batch 32, 50 sampling steps, 2026-11-28: a one-token window 255 ms
    empty, 293 ms half known, 315 ms nine-tenths known, vanilla's steps 343 ms)."""
    b, seq = run.labels.shape[0], model.seq_len
    tokens = torch.zeros(b, seq, model.token_channels, device=model.device, dtype=model.dtype)  # [B, L, C]
    known = torch.zeros(b, seq, dtype=torch.bool, device=model.device)  # [B, L]
    known.scatter_(1, run.orders[:, seq - seq // 2:], True)  # the order's later half

    @torch.no_grad()
    def run_window(width: int) -> None:
        check(width <= seq, f"a window of {width} tokens exceeds the model's {seq} tokens; pass widths up to {seq}.")
        sample_at(model, run, tokens, known, run.orders[:, :width], run.guidance_scale)

    return run_window


class CSpDPipeline(MMSpecPipelineMixin, DiffusionPipeline):
    """A target MAR, a draft MAR sharing its token grid and classes, and their KL VAE."""

    model_cpu_offload_seq = "draft->target->vae"

    def __init__(self, target: MARModel, draft: MARModel, vae: AutoencoderKL) -> None:
        super().__init__()
        check_fits_vae("target", target, vae)
        check_fits_vae("draft", draft, vae)
        check(target.seq_len == draft.seq_len and target.config.num_classes == draft.config.num_classes,
              "the draft MAR must have the target's token grid and classes.")
        check(target.config.timestep_spacing == draft.config.timestep_spacing,
              "the draft and target MARs must use one timestep_spacing (trajectory alignment shares every step).")
        self.register_modules(target=target, draft=draft, vae=vae)
        self.budgets: dict = {}  # budget="auto": what each window budget learnt, kept between calls

    def as_mar_pipeline(self, which: str = "target") -> MARPipeline:
        """Vanilla MAR with the target or the draft model (same VAE)."""
        check(which in ("target", "draft"), f"which must be 'target' or 'draft', got {which!r}.")
        pipe = MARPipeline(transformer=getattr(self, which), vae=self.vae)
        pipe.set_progress_bar_config(**getattr(self, "_progress_bar_config", {}))
        return pipe

    @torch.no_grad()
    def __call__(self, class_labels: int | list[int] | torch.Tensor | None = None, gamma: int = 8,
                 prefill_ratio: float = 0.05, align: bool = True, rule: CSpDRule | None = None,
                 num_sampling_steps: int = 100, guidance_scale: float | None = None, cfg_schedule: str | None = None,
                 temperature: float = 1.0, num_images_per_prompt: int = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "pil",
                 return_dict: bool = True, callback_on_step_end: Callable[[Any, int, int, dict], Any] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None,
                 num_inference_steps: int | None = None, budget: str | None = None):
        """Generate images with CSpD. gamma: window size (with budget="auto", the largest window); prefill_ratio:
        share of tokens the target makes alone first; align: trajectory alignment; rule: the acceptance rule (default
        the paper's `CSpDRule()`; `CSpDRule.reference_code()` for the public code's variants). Other arguments as
        `MARPipeline` with num_iter = the token count (guidance_scale / cfg_schedule None: the target's
        defaults). out.stats: SpecStats (target / draft forwards, acceptance per window position, extra:
        residual_samples, residual_fallbacks). callback_on_step_end(pipe, step (0-based: target forwards - 1),
        tokens verified in every row, {"tokens": [N, L, C]}) after each pre-filling step and window
        (`callback_on_step_end_tensor_inputs`: ["tokens"]; a function or a diffusers `PipelineCallback`;
        `pipe._interrupt = True` stops after the current window and decodes the tokens verified so far).
        return_dict=False returns `(images,)`. num_inference_steps: diffusers' name for num_sampling_steps (the
        diffusion head's steps). budget: None
        (default) or "fixed" drafts gamma every step, the paper's loop (CSpD's rule is relaxed: its output law
        depends on the windows drafted, so the default does not depend on the machine's timings); "auto" picks each
        step's window, 1 (a plain target step) to gamma, from this device's measured costs and the tokens windows
        have given so far (`cspd_budget`), and a seeded call then depends on the measured times. out.stats.extra
        counts the windows chosen (`budget_k`: k drafts after the first window token, a window of k + 1;
        `budget_0` plain)."""
        check_budget_mode(budget)
        user_step = self.step_callback(callback_on_step_end, callback_on_step_end_tensor_inputs,
                                       self.target.seq_len)
        num_sampling_steps = inference_steps(num_sampling_steps, num_inference_steps)
        target, seq = self.target, self.target.seq_len
        check_window_settings(gamma, prefill_ratio)
        check(isinstance(temperature, (int, float)) and temperature > 0,
              f"CSpD compares the two heads' Gaussians, so temperature must be > 0, got {temperature!r}.")
        run = prepare_run(target, class_labels, guidance_scale, cfg_schedule, temperature, num_sampling_steps,
                          num_images_per_prompt, generator, output_type)
        draft_noise = run
        if not align:  # the draft's own noise, drawn after everything the target uses
            _, x_start, step_noise = draw_randomness(generator, run.labels.shape[0], seq, num_sampling_steps,
                                                     target.token_channels, target.device)
            draft_noise = dataclasses.replace(run, x_start=x_start.to(run.x_start.dtype),
                                              step_noise=step_noise.to(run.x_start.dtype))
        with self.progress_bar(total=seq) as bar:
            steps = itertools.count()

            def on_progress(verified: int, tokens: torch.Tensor) -> bool:
                bar.update(verified - bar.n)
                return user_step(next(steps), verified, {"tokens": tokens})

            rule = rule or CSpDRule()
            config = budget_config(budget, rule)
            window_budget = None if config is None or gamma == 1 else cspd_budget(
                target, self.draft, run, gamma, self.budgets, repr(vars(rule)), config)
            tokens, stats = cspd_loop(target, self.draft, run, draft_noise, gamma, prefill_ratio, rule, generator,
                                      on_progress, window_budget)
        return finish_run(self, target, self.vae, tokens, output_type, return_dict, stats)
