"""Decoding methods of the LlamaGen pipeline: each builds a drafter and an acceptance rule for the shared loop.

A method is a function `make(ctx, **kwargs) -> (drafter, rule)` registered under a name; the pipeline's
`method=` argument and `mmspec generate --method` pick it. Issue-by-issue the registry grows (SJD, GSD, LANTERN,
EAGLE); every method runs through `mmspec.loop.generate`, batched, with classifier-free guidance as one 2B batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.errors import InputError, check
from mmspec.lm import DraftModelDrafter, NoDrafter, PrefillFn
from mmspec.sampling import SamplingParams


@dataclass
class MethodContext:
    """What a method may use to build its drafter."""

    pipeline: Any  # the LlamaGenPipeline (its transformer, vqvae, optional draft_transformer)
    params: SamplingParams  # the target's sampling settings
    guidance_scale: float | None  # None = no CFG
    prefill_fn: PrefillFn  # runs the condition for a model: (model, labels/embeddings, extra) -> (cache, logits)
    generator: torch.Generator | list[torch.Generator] | None
    batch_size: int

    def rule_name(self) -> str:
        return "greedy" if self.params.greedy else "lossless"

    def neighbour_table(self, k: int) -> torch.Tensor:
        """LANTERN's latent-neighbour table of the VQ codebook (raw codebook vectors, as the reference code), built
        once per pipeline and kept on it."""
        cache = self.pipeline.__dict__.setdefault("_mmspec_neighbour_tables", {})
        if k not in cache:
            from mmspec.verify import build_neighbour_table

            cache[k] = build_neighbour_table(self.pipeline.vqvae.quantize.embedding.weight.detach().float().cpu(), k)
        return cache[k]

    def token_embeddings(self, table: str | None = "target") -> torch.Tensor | None:
        """GSD's embedding table [V, C]: "target" the transformer's input token embeddings (as the official GSD code
        uses Lumina-mGPT's `embed_tokens`; the default), "codebook" the L2-normalised VQ codebook (the latents the
        decoder sees), None no table (probability test only)."""
        check(table in GSD_EMBEDDINGS, f"embeddings must be 'target', 'codebook' or None, got {table!r}.")
        if table == "target":
            return self.pipeline.transformer.tok_embeddings.weight.detach().float()
        if table == "codebook":
            return self.pipeline.vqvae.codebook().detach().float()
        return None


GSD_EMBEDDINGS = ("target", "codebook", None)
# acceptance modes and the parameters each takes
MODE_PARAMS = {"lossless": (), "lantern": ("k", "delta", "lam", "reject"),
               "gsd": ("group_size", "p_thr", "d_thr", "embeddings", "group_window")}
ACCEPT_MODES = tuple(MODE_PARAMS)


def acceptance_rule(ctx: MethodContext, accept: str = "lossless", **params):
    """The acceptance rule of a method: `accept` names the mode, `params` its parameters.

    lossless: exact (greedy at temperature 0). lantern: k (1000), delta (0.1) or lam, reject ('moved' | 'code');
    at temperature 0 its greedy variant. gsd: group_size (50), p_thr (0.15), d_thr (0.5), embeddings ("target": the
    transformer's token embeddings | "codebook" | None), group_window ("shifted" | "code": GSDRule's window).
    """
    from mmspec.verify import GSDRule, LanternRule

    if accept not in MODE_PARAMS:
        raise InputError(f"unknown acceptance mode {accept!r}; choose one of {', '.join(ACCEPT_MODES)}.")
    unknown = sorted(set(params) - set(MODE_PARAMS[accept]))
    if unknown:
        takes = ", ".join(MODE_PARAMS[accept]) or "no parameters"
        raise InputError(f"accept={accept!r} takes {takes}; got {', '.join(unknown)}.")
    if accept == "lossless":
        return ctx.rule_name()
    if accept == "lantern":
        k = int(params.pop("k", 1000))
        table = ctx.neighbour_table(min(k, ctx.pipeline.vqvae.config.codebook_size - 1))
        return LanternRule(table, k=k, greedy=ctx.params.greedy, **params)
    # gsd: at temperature 0 p is one-hot, and grouped acceptance reduces to greedy verification
    table = ctx.token_embeddings(params.pop("embeddings", "target"))
    return GSDRule(embeddings=table, window=params.pop("group_window", "shifted"), **params)


MethodFactory = Callable[..., tuple[Any, Any]]
# lossless(params) -> whether the method keeps the target distribution exactly with these parameters
LosslessFn = Callable[[dict], bool]
_METHODS: dict[str, MethodFactory] = {}
_LOSSLESS: dict[str, LosslessFn] = {}
_PASSTHROUGH: dict[str, tuple[str, ...]] = {}
# the parameters `acceptance_rule` takes for its non-default modes (what a method's `**accept_params` may hold)
ACCEPT_PARAMS = tuple(name for names in MODE_PARAMS.values() for name in names)


def accepts_losslessly(params: dict) -> bool:
    """The default: exact unless an `accept` mode other than 'lossless' is chosen."""
    return params.get("accept", "lossless") == "lossless"


def register_method(name: str, lossless: LosslessFn = accepts_losslessly,
                    passthrough: tuple[str, ...] = ()) -> Callable[[MethodFactory], MethodFactory]:
    """Register `make(ctx, **params) -> (drafter, rule)` under `name`; `lossless(params)` says whether it is exact;
    `passthrough` names the parameters its `**kwargs` forwards (listed by `method_parameters`)."""

    def wrap(fn: MethodFactory) -> MethodFactory:
        _METHODS[name] = fn
        _LOSSLESS[name] = lossless
        _PASSTHROUGH[name] = tuple(passthrough)
        return fn

    return wrap


def available_methods() -> list[str]:
    return list(_METHODS)


def is_lossless(name: str, params: dict | None = None) -> bool:
    """Whether method `name` with `params` keeps the target's output distribution exactly."""
    if name not in _METHODS:
        raise InputError(f"unknown LlamaGen method {name!r}; available: {', '.join(available_methods())}.")
    return _LOSSLESS[name](dict(params or {}))


def method_parameters(name: str) -> dict[str, Any]:
    """The parameters method `name` takes, with their defaults; those its `**kwargs` forwards default to None
    (None = not given: callers drop None values before building the method)."""
    import inspect

    if name not in _METHODS:
        raise InputError(f"unknown LlamaGen method {name!r}; available: {', '.join(available_methods())}.")
    params = {p.name: p.default for p in list(inspect.signature(_METHODS[name]).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {**params, **{key: None for key in _PASSTHROUGH[name] if key not in params}}


def build_method(name: str, ctx: MethodContext, **kwargs) -> tuple[Any, Any]:
    if name not in _METHODS:
        raise InputError(f"unknown LlamaGen method {name!r}; available: {', '.join(available_methods())}.")
    try:
        return _METHODS[name](ctx, **kwargs)
    except TypeError as err:
        raise InputError(f"bad parameters for method {name!r}: {err}") from None


@register_method("vanilla")
def vanilla(ctx: MethodContext) -> tuple[Any, Any]:
    """One target forward per token (the reference every method is compared with)."""
    return NoDrafter(), ctx.rule_name()


@register_method("draft-model")
def draft_model(ctx: MethodContext, num_draft_tokens: int = 4, draft_temperature: float | None = None) -> tuple:
    """Classic speculative sampling with the pipeline's small `draft_transformer` (same VQ vocabulary), which
    drafts with the same CFG and sampling settings (its own temperature if given); lossless."""
    draft = ctx.pipeline.draft_transformer
    check(draft is not None, "method 'draft-model' needs a pipeline with a draft_transformer component.")
    target = ctx.pipeline.transformer
    check(draft.config.vocab_size == target.config.vocab_size,
          f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's "
          f"({target.config.vocab_size}); they must share the VQ codebook.")
    params = ctx.params if draft_temperature is None else SamplingParams(draft_temperature, ctx.params.top_k,
                                                                         ctx.params.top_p)
    drafter = DraftModelDrafter(draft, num_draft_tokens, params, ctx.generator, guidance_scale=ctx.guidance_scale,
                                prefill_fn=ctx.prefill_fn)
    return drafter, ctx.rule_name()


# method modules register themselves on import (they need register_method and acceptance_rule defined above)
from image_ar.llamagen import eagle_methods, jacobi_methods  # noqa: E402,F401  (eagle, lantern, sjd, gsd)
