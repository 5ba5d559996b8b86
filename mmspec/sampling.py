"""Sampling: logits processing, probabilities, and randomness drawn from per-row generators.

Everything is batched. Sampling uses the exponential race, `argmax(w / E)` with `E ~ Exp(1)` drawn in float64:
it samples index i with probability w_i / sum(w) for any non-negative weights `w` (no normalisation, no
`torch.multinomial`, no host synchronisation), and it lets the caller draw the randomness up front from the
user's generators, so the functions that consume it are pure.

Generators: pass one `torch.Generator` for the whole batch, a list with one generator per row (what makes a
row's output independent of the batch it is in), or None for torch's global generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.errors import InputError, check, check_nonnegative, check_probability

Generators = torch.Generator | Sequence[torch.Generator] | None

# smallest float64 we let an exponential take; keeps `w / E` finite
_TINY = 1e-300


# --------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class SamplingParams:
    """How target (and draft) logits become a distribution.

    temperature 0 means greedy (argmax); top_k 0 means no top-k filter; top_p 1.0 means no nucleus filter.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        validate_sampling_args(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def lossless_rule(self) -> str:
        """The lossless acceptance rule for these settings: "greedy" at temperature 0 (the same tokens as "lossless"
        on one-hot p, without drawing [B, K+1, V] randomness each step), else "lossless"."""
        return "greedy" if self.greedy else "lossless"

    def exact_rule(self, accept: str) -> str:
        """The rule of an exact acceptance mode: "lossless" (speculative sampling) or "coupled" (the target's own
        sample at every index: vanilla's tokens for the same generators, `mmspec.verify.coupled`); "greedy" at
        temperature 0, where both are greedy verification."""
        check_exact_mode(accept)
        return "greedy" if self.greedy else accept


EXACT_MODES = ("lossless", "coupled")  # the exact acceptance modes (`SamplingParams.exact_rule`)


def check_exact_mode(accept: Any) -> None:
    check(accept in EXACT_MODES, f"accept must be one of {', '.join(EXACT_MODES)}, got {accept!r}.")


def validate_sampling_args(temperature: float, top_k: int, top_p: float) -> None:
    check(isinstance(temperature, (int, float)), f"temperature must be a number, got {temperature!r}.")
    check_nonnegative("temperature", temperature)
    check(
        isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0,
        f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}.",
    )
    check(isinstance(top_p, (int, float)), f"top_p must be a number, got {top_p!r}.")
    check_probability("top_p", top_p)


# ------------------------------------------------------------------------------------------ logits -> probs
def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance on logits: `uncond + scale * (cond - uncond)`.

    `scale` may be a tensor broadcastable to the logits (e.g. [B, 1, 1] for per-row or per-step schedules).
    """
    if cond.shape != uncond.shape:
        raise InputError(
            f"cond and uncond logits must have the same shape, got {list(cond.shape)} and {list(uncond.shape)}."
        )
    return uncond + scale * (cond - uncond)


def split_cfg_batch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a CFG batch of 2B rows laid out [cond rows ; uncond rows] into (cond, uncond)."""
    check(logits.shape[0] % 2 == 0, f"a CFG batch needs an even number of rows, got {logits.shape[0]}.")
    return logits.chunk(2, dim=0)


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits along the last axis, set the rest to -inf (0 = off)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of tokens whose probability reaches `top_p` (1.0 = off).

    The most likely token is always kept.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [..., V]
    sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    drop_sorted = mass_before >= top_p  # [..., V]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (LlamaGen's order). Returns float32 logits with -inf masks.

    temperature 0 leaves the logits unscaled (the caller takes the argmax).
    """
    out = logits.float()
    if temperature > 0 and temperature != 1.0:
        out = out / temperature
    out = filter_top_k(out, top_k)
    return filter_top_p(out, top_p)


def greedy_probs(logits: torch.Tensor) -> torch.Tensor:
    """One-hot distribution on the argmax (first index on ties). [..., V] float32."""
    idx = logits.argmax(-1, keepdim=True)
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution for `logits` [..., V] -> probs [..., V] float32 (one-hot when greedy)."""
    if temperature == 0:
        return greedy_probs(logits)
    return torch.softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)


def probs_from_params(logits: torch.Tensor, params: SamplingParams, soft_greedy: bool = False) -> torch.Tensor:
    """The distribution `params` sample from; `soft_greedy`: at temperature 0, the softmax of the logits (temperature
    1, no filters) instead of the one-hot argmax, for a relaxed greedy rule that moves mass between tokens
    (`AcceptanceRule.greedy_reads_softmax`); its argmax is the one-hot's."""
    if soft_greedy and params.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return logits_to_probs(logits, params.temperature, params.top_k, params.top_p)


# --------------------------------------------------------------------------------------------- randomness
def check_generator_types(generator: Any) -> None:
    """generator is None, one torch.Generator or a list / tuple of them (InputError otherwise)."""
    if not (generator is None or isinstance(generator, torch.Generator) or (
            isinstance(generator, (list, tuple)) and all(isinstance(g, torch.Generator) for g in generator))):
        raise InputError(f"generator must be a torch.Generator, a list of them (one per row) or None, got "
                         f"{repr(generator)[:80]}.")


def generator_list(generator: Generators, batch: int) -> list[torch.Generator] | None:
    """The per-row generators of a list (checked: one per row), or None for a single generator or None."""
    check_generator_types(generator)
    if generator is None or isinstance(generator, torch.Generator):
        return None
    gens = list(generator)
    if len(gens) != batch:
        raise InputError(
            f"got {len(gens)} generators for a batch of {batch} rows; pass one generator per row, "
            "a single generator, or None."
        )
    return gens


def uniform(shape: Sequence[int], generator: Generators = None, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Uniforms in [0, 1), float64 by default; row b of dim 0 comes from generator b when a list is given.

    A generator on another device than `device` (a CPU generator for CUDA tensors, as diffusers allows) draws
    where it lives and the numbers are moved: a seeded CPU generator gives the same numbers on any device."""
    shape = tuple(shape)
    gens = generator_list(generator, shape[0]) if shape else None
    if gens is None:
        return _rand(shape, generator, device, dtype)
    # one draw per row: the loop only draws random numbers, it does no computation on the batch
    return torch.stack([_rand(shape[1:], g, device, dtype) for g in gens])


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str,
          dtype: torch.dtype) -> torch.Tensor:
    device = torch.device(device)
    if generator is None or generator.device.type == device.type:
        return torch.rand(shape, generator=generator, device=device, dtype=dtype)
    return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def exponential(shape: Sequence[int], generator: Generators = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) samples in float64, strictly positive (for the exponential race)."""
    u = uniform(shape, generator, device)  # [0, 1)
    return (-torch.log1p(-u)).clamp_min(_TINY)


def race(weights: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """Sample an index along the last axis with probability proportional to `weights` (>= 0).

    `exponentials` are Exp(1) draws broadcastable to `weights`. All-zero weights return index 0; callers
    guard against that case by falling back to a proper distribution.
    """
    return (weights.double() / exponentials).argmax(-1)


def sample(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """Sample one token per distribution: probs [B, ..., V] -> tokens [B, ...] int64."""
    return race(probs, exponential(probs.shape, generator, probs.device))


def sample_logits(logits: torch.Tensor, params: SamplingParams,
                  generator: Generators = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Process logits with `params` and sample: returns (tokens [B, ...], probs [B, ..., V])."""
    probs = probs_from_params(logits, params)
    if params.greedy:
        return logits.argmax(-1), probs
    return sample(probs, generator), probs
