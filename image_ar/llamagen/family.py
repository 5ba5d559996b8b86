"""The LlamaGen family record: its pipeline folders, its `mmspec generate` / demo / bench hooks, and every decoding
method of `LlamaGenPipeline`, each declared once here (`mmspec.families`).

    pipe(class_labels=[0, 5], method="sjd", method_kwargs={"window": 16, "accept": "lantern", "delta": 0.1})

A method builds `(drafter, rule)` for the shared loop from a `MethodContext`; its parameters and defaults are read
from the drafter and rule constructors it forwards to (`image_ar.llamagen.methods`), its losslessness from the
acceptance rule its parameters select. See docs/llamagen_pipeline.md, docs/sjd_gsd.md and docs/eagle_lantern.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from image_ar.llamagen.eagle import EagleTreeDrafter
from image_ar.llamagen.methods import (
    ACCEPT_RULES,
    GSD_TABLE,
    SUPPLIED,
    MethodContext,
    acceptance_rule,
    check_accept,
    check_jacobi,
    eagle_tree_drafter,
    llamagen_jacobi_drafter,
)
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.errors import check, check_positive_int
from mmspec.families import FamilyRecord, model_guidance_defaults, split
from mmspec.lm import DraftModelDrafter, NoDrafter
from mmspec.sampling import SamplingParams, check_exact_mode
from mmspec.stats import SpecStats
from mmspec.verify import CappedRule, GSDRule, LanternRule, rule_keeps_distribution

DEFAULTS = {"guidance_scale": 4.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
TREE = (EagleTreeDrafter,)  # top_k, depth, total_tokens
TREE_SKIP = ("guidance_scale",)
# `accept` and every mode's rule parameters; the exact default is "coupled": a seed gives vanilla's image whatever
# is drafted (docs/verify.md; its acceptance is within 5% of speculative sampling's, measured there)
ACCEPT = ({"accept": "coupled"}, LanternRule, GSDRule, GSD_TABLE)
CHAIN_ACCEPT = (*ACCEPT, CappedRule)  # chains (Jacobi windows) also take the capped rule


def load(model_path: str | None, device: str, dtype=None):
    from image_ar.llamagen.pipeline import LlamaGenPipeline
    from mmspec.cli.family_io import load_pipeline_folder

    return load_pipeline_folder(LlamaGenPipeline, model_path, ASSETS_DIR / "llamagen", family="LlamaGen",
                                made_by="mmspec train llamagen",
                                converted_by="mmspec convert llamagen --gpt c2i_*.pt --vq vq_ds16_*.pt --out DIR",
                                device=device, dtype=dtype)


def generate(pipe, labels: list[int], generators: list[torch.Generator], options: dict) -> tuple[list, SpecStats]:
    out = pipe(class_labels=labels, generator=generators, output_type="pil", **options)
    return out.images, out.stats


def bench():
    from image_ar.llamagen.bench import llamagen_family

    return llamagen_family()


def profile(pipe) -> dict:
    """The target and the draft model as the loop runs them: the class condition prefilled, CFG at the pipeline's
    default scale (one 2B batch), then W new tokens scored per forward; the EAGLE drafter as its trees run it: W new
    (token, feature) pairs after half an image's pairs (`mmspec.profiling.feature_forward_runner`)."""
    from image_ar.llamagen.pipeline import condition_prefill
    from mmspec.profile_runners import feature_forward_runner, lm_forward_runner

    def labels(batch: int) -> torch.Tensor:
        return torch.arange(batch, device=pipe.transformer.device) % pipe.transformer.config.num_classes

    scale = DEFAULTS["guidance_scale"]
    models = {"transformer": pipe.transformer, "draft_transformer": pipe.draft_transformer}
    runners = {name: (model, lm_forward_runner(model, labels, scale, condition_prefill(True),
                                               max_width=model.config.block_size))
               for name, model in models.items() if model is not None}
    eagle = getattr(pipe, "eagle_drafter", None)
    if eagle is not None:  # attached as the tree drafter attaches it (the target's embeddings and head)
        eagle.attach(pipe.transformer)
        runners["eagle_drafter"] = (eagle, feature_forward_runner(eagle, eagle.dim, eagle.block_size // 2,
                                                                  scale, max_width=eagle.block_size))
    return runners


# DEFAULTS with the model's own guidance scale (`LlamaGenPipeline.default_guidance_scale`) once loaded
sampling_defaults = model_guidance_defaults(DEFAULTS)


FAMILY = FamilyRecord("llamagen", "LlamaGen class-conditional image generation (judge accuracy, world-FID)",
                      default_model=ASSETS_DIR / "llamagen", load=load, generate=generate,
                      num_classes=lambda pipe: pipe.transformer.config.num_classes,
                      sampling_defaults=sampling_defaults, bench=bench, profile=profile)


def rule_lossless(mode: str | None = None):
    """`lossless(params)` of a method whose rule is `mode` (None: the one its `accept` parameter names), read from
    that rule with the parameters."""

    def lossless(params: Mapping[str, Any]) -> bool:
        name = mode or params.get("accept", "coupled")
        if name not in ACCEPT_RULES:  # an unknown mode: building the method says so
            return False
        rule = ACCEPT_RULES[name]
        return rule is None or rule_keeps_distribution(rule.name, dict(params))

    return lossless


def jacobi_checks(mode: str | None = None) -> Callable[[Mapping[str, Any]], None]:
    """`check(given)` of a Jacobi method whose rule is `mode` (None: the one its `accept` parameter names): the
    drafter's and the rule's checks that need no model, so a command refuses a bad value before it loads one."""

    def check_given(given: Mapping[str, Any]) -> None:
        jacobi, rule = split(given, llamagen_jacobi_drafter)
        check_jacobi(**jacobi)
        check_accept(mode or rule.pop("accept", "coupled"), rule)

    return check_given


def check_tree_accept(given: Mapping[str, Any]) -> None:
    """`check(given)` of an EAGLE tree method: its acceptance mode exists, takes the given rule parameters and
    verifies trees (the Jacobi-only modes verify chains)."""
    rule = split(given, *TREE)[-1]
    accept = rule.pop("accept", "coupled")
    check_accept(accept, rule)
    mode = ACCEPT_RULES[accept]
    check(mode is None or mode.supports_tree, f"accept={accept!r} verifies chains only (Jacobi windows); EAGLE "
                                              "trees take " + ", ".join(
                                                  m for m, c in ACCEPT_RULES.items() if c is None or c.supports_tree))


@FAMILY.method()
def vanilla(ctx: MethodContext) -> tuple:
    """One target forward per token (the reference every method is compared with)."""
    return NoDrafter(), ctx.rule_name()


def check_draft_model(given: Mapping[str, Any]) -> None:
    """`check(given)` of draft-model: the draft size and the exact acceptance mode (no model needed)."""
    check_positive_int("num_draft_tokens", given.get("num_draft_tokens", 1))
    check_exact_mode(given.get("accept", "coupled"))


@FAMILY.method(needs=("draft_transformer",), check=check_draft_model)
def draft_model(ctx: MethodContext, num_draft_tokens: int = 4, draft_temperature: float | None = None,
                accept: str = "coupled") -> tuple:
    """Classic speculative sampling with the pipeline's small draft_transformer (same VQ vocabulary, same CFG and
    sampling settings, its own temperature if given); lossless (accept "coupled", vanilla's tokens for the same
    generators, or "lossless", speculative sampling)."""
    draft = ctx.pipeline.draft_transformer
    check(draft is not None, "method 'draft-model' needs a pipeline with a draft_transformer component.")
    target = ctx.pipeline.transformer
    check(draft.config.vocab_size == target.config.vocab_size,
          f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's "
          f"({target.config.vocab_size}); they must share the VQ codebook.")
    params = ctx.params if draft_temperature is None else SamplingParams(draft_temperature, ctx.params.top_k,
                                                                         ctx.params.top_p)
    drafter = DraftModelDrafter(draft, num_draft_tokens, params, guidance_scale=ctx.guidance_scale,
                                prefill_fn=ctx.prefill_fn)
    return drafter, ctx.params.exact_rule(accept)


@FAMILY.method(params=(llamagen_jacobi_drafter, *CHAIN_ACCEPT), skip=SUPPLIED, lossless=rule_lossless(),
               check=jacobi_checks())
def sjd(ctx: MethodContext, **given: Any) -> tuple:
    """Speculative Jacobi decoding: a window of drafts re-sampled from the target every forward; accept="lossless"
    (exact; greedy at temperature 0), "lantern", "gsd" or "capped" (Lumina-mGPT 2.0's code) with that rule's
    parameters."""
    jacobi, rule = split(given, llamagen_jacobi_drafter)
    return llamagen_jacobi_drafter(ctx, **jacobi), acceptance_rule(ctx, **rule)


@FAMILY.method(params=(llamagen_jacobi_drafter, GSDRule, GSD_TABLE), skip=SUPPLIED, lossless=rule_lossless("gsd"),
               check=jacobi_checks("gsd"))
def gsd(ctx: MethodContext, **given: Any) -> tuple:
    """Grouped speculative decoding: SJD drafting, GSD's grouped acceptance (lossy; g = 50 is the paper's
    PartiPrompts setting, the public code's is 14 with group_window="code")."""
    jacobi, rule = split(given, llamagen_jacobi_drafter)
    return llamagen_jacobi_drafter(ctx, **jacobi), acceptance_rule(ctx, "gsd", **rule)


@FAMILY.method(params=(*TREE, *ACCEPT), skip=(*SUPPLIED, *TREE_SKIP), lossless=rule_lossless(),
               needs=("eagle_drafter",), check=check_tree_accept)
def eagle(ctx: MethodContext, **given: Any) -> tuple:
    """EAGLE-2 dynamic trees from the eagle_drafter (top_k children per frontier node, depth levels, total_tokens
    nodes including the root), lossless tree verification by default (accept= another mode)."""
    tree, rule = split(given, *TREE)  # the rule's mode verifies trees: check_tree_accept
    return eagle_tree_drafter(ctx, "eagle", **tree), acceptance_rule(ctx, **rule)


@FAMILY.method(params=(*TREE, LanternRule), skip=(*SUPPLIED, *TREE_SKIP), lossless=rule_lossless("lantern"),
               needs=("eagle_drafter",))
def lantern(ctx: MethodContext, **given: Any) -> tuple:
    """LANTERN: EAGLE-2 trees + relaxed acceptance over the VQ codebook's latent neighbours (k, delta, or the
    LANTERN++ lam)."""
    tree, rule = split(given, *TREE)
    return eagle_tree_drafter(ctx, "lantern", **tree), acceptance_rule(ctx, "lantern", **rule)
