"""LlamaGen methods built on speculative Jacobi decoding: `sjd` and `gsd` (registered in the method registry).

    pipe(class_labels=[0, 5], method="sjd", method_kwargs={"window": 16, "init": "random"})
    pipe(class_labels=[0, 5], method="sjd", method_kwargs={"accept": "lantern", "k": 1000, "delta": 0.1})
    pipe(class_labels=[0, 5], method="gsd", method_kwargs={"group_size": 50})

Both draft with `mmspec.jacobi.JacobiDrafter` (no model of their own: the drafts are re-sampled from the target's
own distributions, which already include CFG, temperature and top-k/top-p); `sjd` verifies with any acceptance
mode of `methods.acceptance_rule` (lossless by default: exact), `gsd` with GSD's grouped rule (lossy). Every
row of a batch accepts its own number of drafts. See docs/sjd_gsd.md.
"""

from __future__ import annotations

from typing import Any

from image_ar.llamagen.methods import ACCEPT_PARAMS, MethodContext, acceptance_rule, register_method
from image_ar.llamagen.rope import grid_size_of
from mmspec.errors import check, check_positive_int
from mmspec.jacobi import JacobiDrafter, check_init, check_interval
from mmspec.lm import DRAFT_ROOM

# LMTarget (as the pipeline builds it) keeps room for DRAFT_ROOM draft entries after the last token
MAX_WINDOW = DRAFT_ROOM + 1


def resolve_interval(interval: Any, block_size: int, window: int) -> tuple[int, int]:
    """The image-token indices where Jacobi runs: None = the whole image, "reference" = the official LlamaGen
    script's (3, block_size - window - 2) (docs/sjd_gsd.md), or (start, end) with 0 <= start < end <= block_size."""
    if interval is None:
        return 0, block_size
    if interval == "reference":
        interval = (3, block_size - window - 2)
        check(interval[1] > interval[0], f"interval='reference' is ({interval[0]}, {interval[1]}), empty for "
                                         f"block_size {block_size} and window {window}; pass (start, end).")
    start, end = check_interval(interval)
    end = block_size if end is None else end
    check(start < block_size and end <= block_size,
          f"interval {interval!r} must lie inside the image: 0 <= start < end <= block_size ({block_size}).")
    return start, end


def llamagen_jacobi_drafter(ctx: MethodContext, window: int = 16, init: str = "random",
                            interval: Any = None) -> JacobiDrafter:
    """A JacobiDrafter over the pipeline's VQ vocabulary, with the image row width for the horizon inits,
    the user's generator(s), and greedy tails at temperature 0."""
    check_positive_int("window", window)
    check(window <= MAX_WINDOW, f"window must be <= {MAX_WINDOW} (the target's cache keeps room for "
                                f"{MAX_WINDOW - 1} drafts), got {window}.")
    check_init(init)
    config = ctx.pipeline.transformer.config
    start, end = resolve_interval(interval, config.block_size, window)
    return JacobiDrafter(config.vocab_size, window, init, interval=(start, end), generator=ctx.generator,
                         greedy=ctx.params.greedy, row_width=grid_size_of(config.block_size))


@register_method("sjd", passthrough=ACCEPT_PARAMS)
def sjd(ctx: MethodContext, window: int = 16, init: str = "random", interval: Any = None,
        accept: str = "lossless", **accept_params) -> tuple[JacobiDrafter, Any]:
    """Speculative Jacobi decoding: a window of `window` positions re-sampled from the target every forward.

    init: "random" (Lumina-mGPT setting) | "repeat_horizon" (LlamaGen t2i setting) | "sample_horizon".
    interval: None (the whole image), "reference" ((3, block_size - window - 2), the official LlamaGen script) or
    (start, end) image-token indices: a row drafts only when its next token index is >= start, and never a token
    index >= end. accept: "lossless" (exact; greedy at temperature 0) | "lantern" | "gsd", with that rule's
    parameters (`accept_params`, see `methods.acceptance_rule`).
    """
    drafter = llamagen_jacobi_drafter(ctx, window, init, interval)
    return drafter, acceptance_rule(ctx, accept, **accept_params)


@register_method("gsd", lossless=lambda params: params.get("group_size", 50) == 1)
def gsd(ctx: MethodContext, window: int = 16, init: str = "random", interval: Any = None, group_size: int = 50,
        p_thr: float = 0.15, d_thr: float = 0.5, embeddings: str | None = "target",
        group_window: str = "shifted") -> tuple[JacobiDrafter, Any]:
    """Grouped speculative decoding: SJD drafting, GSD's grouped acceptance (lossy).

    group_size 50 is the paper's PartiPrompts setting (25 for COCO; the public code hard-codes 14). p_thr 0.15
    and d_thr 0.5 are the public code's. embeddings: the table of the distance test: "target" (the transformer's
    input token embeddings, as the public code uses Lumina-mGPT's; default), "codebook" (the L2-normalised VQ
    codebook; what mmspec used before 2026-11-24) or None (probability test only). group_window: "shifted" (default)
    or "code" (the public code's slice at the ends of the probability ranking; see mmspec.verify.gsd).
    """
    drafter = llamagen_jacobi_drafter(ctx, window, init, interval)
    return drafter, acceptance_rule(ctx, "gsd", group_size=group_size, p_thr=p_thr, d_thr=d_thr,
                                    embeddings=embeddings, group_window=group_window)
