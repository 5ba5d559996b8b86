"""LlamaGen methods on EAGLE-2 trees from the pipeline's `eagle_drafter`: `eagle` (lossless) and `lantern`.

    pipe(class_labels=[0, 1], method="eagle")                                  # lossless tree verification
    pipe(class_labels=[0, 1], method="eagle", method_kwargs={"top_k": 8, "depth": 5, "total_tokens": 40})
    pipe(class_labels=[0, 1], method="lantern", method_kwargs={"delta": 0.1})  # LANTERN relaxed acceptance

Both build an `EagleTreeDrafter` (image_ar/llamagen/eagle.py) that drafts with the target's CFG scale and
sampling settings; `eagle` verifies the trees losslessly (greedy at temperature 0) or with any acceptance mode
of `methods.acceptance_rule` (`accept="lantern"` / `"gsd"` + parameters), `lantern` is LANTERN's setting:
EAGLE trees + relaxed acceptance over the VQ codebook's latent neighbours.
"""

from __future__ import annotations

from typing import Any

from image_ar.llamagen.eagle import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS, EagleTreeDrafter
from image_ar.llamagen.methods import ACCEPT_PARAMS, MethodContext, acceptance_rule, register_method
from mmspec.errors import InputError

TRAIN_HINT = ("train one with `mmspec train llamagen-drafter --pipeline PIPELINE --out PIPELINE/eagle_drafter` "
              "(it registers the component in PIPELINE/model_index.json), or pass eagle_drafter= to the pipeline")


def eagle_tree_drafter(ctx: MethodContext, method: str, top_k: int = DEFAULT_TOP_K, depth: int = DEFAULT_DEPTH,
                       total_tokens: int = DEFAULT_TOTAL_TOKENS) -> EagleTreeDrafter:
    """The pipeline's eagle_drafter as the loop's EAGLE-2 tree drafter (InputError when there is none)."""
    model = getattr(ctx.pipeline, "eagle_drafter", None)
    if model is None:
        raise InputError(f"method {method!r} needs a pipeline with an eagle_drafter component; {TRAIN_HINT}.")
    return EagleTreeDrafter(model, ctx.pipeline.transformer, ctx.params, top_k=top_k, depth=depth,
                            total_tokens=total_tokens, guidance_scale=ctx.guidance_scale)


@register_method("eagle", passthrough=ACCEPT_PARAMS)
def eagle(ctx: MethodContext, top_k: int = DEFAULT_TOP_K, depth: int = DEFAULT_DEPTH,
          total_tokens: int = DEFAULT_TOTAL_TOKENS, accept: str = "lossless", **accept_params: Any) -> tuple:
    """EAGLE-2 dynamic trees from the eagle_drafter (top_k children per frontier node, `depth` levels,
    `total_tokens` nodes including the root), lossless tree verification by default."""
    drafter = eagle_tree_drafter(ctx, "eagle", top_k, depth, total_tokens)
    return drafter, acceptance_rule(ctx, accept, **accept_params)


@register_method("lantern", lossless=lambda params: params.get("delta", 0.1) == 0 and params.get("lam") is None,
                 passthrough=("top_k", "depth", "total_tokens"))
def lantern(ctx: MethodContext, k: int = 1000, delta: float | None = 0.1, lam: float | None = None,
            reject: str = "moved", **tree_params: Any) -> tuple:
    """LANTERN: EAGLE-2 trees + relaxed acceptance (k latent neighbours, total-variation budget `delta`, or the
    LANTERN++ form `lam`); tree_params: top_k, depth, total_tokens as for `eagle`."""
    drafter = eagle_tree_drafter(ctx, "lantern", **tree_params)
    return drafter, acceptance_rule(ctx, "lantern", k=k, delta=delta, lam=lam, reject=reject)
