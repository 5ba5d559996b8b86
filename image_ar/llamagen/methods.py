"""The building blocks of the LlamaGen methods (declared in `image_ar.llamagen.family`): what a method may use
(`MethodContext`), its acceptance rule by mode (`acceptance_rule`), the Jacobi drafter of `sjd` / `gsd` and the
EAGLE-2 tree drafter of `eagle` / `lantern`.

    ctx = MethodContext(pipe, SamplingParams(1.0), guidance_scale=4.0, prefill_fn=..., batch_size=2)
    rule = acceptance_rule(ctx, "lantern", delta=0.2)          # LanternRule over the VQ codebook's neighbours
    drafter = llamagen_jacobi_drafter(ctx, window=16)           # SJD's window over the VQ vocabulary

A rule's parameters and their defaults are its constructor's (`mmspec.verify`); the pipeline supplies what comes
from the models: LANTERN's neighbour table (from the VQ codebook, built once per pipeline and k), GSD's embedding
table (`embeddings`: "target" the transformer's input token embeddings, "codebook" the VQ codebook, None), and the
greedy variants at temperature 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from image_ar.llamagen.eagle import EagleTreeDrafter
from mmspec.errors import InputError, check, check_positive_int
from mmspec.families import parameters_of
from mmspec.jacobi import JacobiDrafter, check_coupling, check_init, check_interval
from mmspec.lm import DRAFT_ROOM, PrefillFn, TokenLayout
from mmspec.sampling import SamplingParams
from mmspec.verify import AcceptanceRule, CappedRule, GSDRule, LanternRule

# acceptance modes a method's `accept` may name, and the parameters the pipeline supplies to their rules itself
ACCEPT_RULES: dict[str, type[AcceptanceRule] | None] = {"lossless": None, "coupled": None, "lantern": LanternRule,
                                                         "gsd": GSDRule, "capped": CappedRule}
SUPPLIED = ("neighbours", "greedy")
GSD_EMBEDDINGS = ("target", "codebook", None)
# the GSD embedding table is named, not passed: "target" by default (as the official GSD code)
GSD_TABLE = {"embeddings": "target"}
TRAIN_HINT = ("train one with `mmspec train llamagen-drafter --pipeline PIPELINE --out PIPELINE/eagle_drafter` "
              "(it registers the component in PIPELINE/model_index.json), or pass eagle_drafter= to the pipeline")


class ImageTokenPipeline(Protocol):
    """What the methods read from a discrete image pipeline (`LlamaGenPipeline`, `image_ar.transformers_ar`'s):
    the token layout, the VQ codebook and the target's input embeddings of the codes, LANTERN's tables (a dict the
    pipeline keeps, per k), and the optional drafters (None where the pipeline has none: their methods refuse)."""

    lantern_tables: dict[int, torch.Tensor]
    draft_transformer: Any
    eagle_drafter: Any

    def image_token_layout(self) -> tuple[int, int, int]:
        """(image tokens per image, tokens per image row, code vocabulary size)."""

    def code_vectors(self, as_decoded: bool = False) -> torch.Tensor:
        """The VQ codebook [V, C]: its raw vectors, or (as_decoded) the latents the decoder sees."""

    def input_token_embeddings(self) -> torch.Tensor:
        """[V, H] the target's input embeddings of the codes (what it reads for a generated token)."""

    def image_token_ids(self) -> torch.Tensor | None:
        """The image tokens' ids where the vocabulary also holds text (Jacobi's random init draws from them)."""


@dataclass
class MethodContext:
    """What a method may use to build its drafter and rule."""

    pipeline: ImageTokenPipeline  # LlamaGen: its transformer, vqvae, optional draft_transformer and eagle_drafter
    params: SamplingParams  # the target's sampling settings
    guidance_scale: float | None  # None = no CFG
    prefill_fn: PrefillFn  # runs the condition for a model: (model, labels/embeddings, extra) -> (cache, logits)
    batch_size: int
    layout: TokenLayout | None = None  # the tokens each generated-token index allows (Emu3), None = all

    def rule_name(self) -> str:
        return self.params.lossless_rule

    def neighbour_table(self, k: int) -> torch.Tensor:
        """LANTERN's latent-neighbour table of the VQ codebook (raw codebook vectors, as the reference code), built
        once per pipeline and k (`LlamaGenPipeline.lantern_tables`)."""
        tables = self.pipeline.lantern_tables
        if k not in tables:
            from mmspec.verify import build_neighbour_table

            own = getattr(self.pipeline, "lantern_table", None)  # a vocabulary that is not only codes (Emu3)
            tables[k] = own(k) if own is not None else build_neighbour_table(
                self.pipeline.code_vectors().detach().float().cpu(), k)
        return tables[k]

    def token_embeddings(self, table: str | None = "target") -> torch.Tensor | None:
        """GSD's embedding table [V, C]: "target" the transformer's input token embeddings (as the official GSD code
        uses Lumina-mGPT's `embed_tokens`; the default), "codebook" the L2-normalised VQ codebook (the latents the
        decoder sees), None no table (probability test only)."""
        check_gsd_table(table)
        if table == "target":
            return self.pipeline.input_token_embeddings().detach().float()
        if table == "codebook":
            return self.pipeline.code_vectors(as_decoded=True).detach().float()
        return None


def accept_params(mode: str) -> dict[str, Any]:
    """The parameters (with defaults) acceptance mode `mode` takes: its rule constructor's, less what the pipeline
    supplies, with GSD's table named."""
    rule = ACCEPT_RULES[mode]
    if rule is None:
        return {}
    return {**parameters_of(rule, skip=SUPPLIED), **(GSD_TABLE if rule is GSDRule else {})}


def check_gsd_table(table: Any) -> None:
    """GSD's `embeddings` names a table (`MethodContext.token_embeddings`)."""
    check(table in GSD_EMBEDDINGS, f"embeddings must be 'target', 'codebook' or None, got {table!r}.")


def check_accept(accept: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters (with defaults) of acceptance mode `accept`, after checking the mode, that it takes every one
    of `given` and their values (the rule built over a placeholder table: its own checks); InputError otherwise;
    needs no model."""
    if accept not in ACCEPT_RULES:
        raise InputError(f"unknown acceptance mode {accept!r}; choose one of {', '.join(ACCEPT_RULES)}.")
    takes = accept_params(accept)
    unknown = sorted(set(given) - set(takes))
    if unknown:
        raise InputError(f"accept={accept!r} takes {', '.join(takes) or 'no parameters'}; got {', '.join(unknown)}.")
    rule = ACCEPT_RULES[accept]
    if rule is LanternRule:
        LanternRule(torch.zeros(1, 1, dtype=torch.long), **given)  # [1, 1]: the codebook's table comes at the build
    elif rule is GSDRule:
        check_gsd_table(given.get("embeddings", GSD_TABLE["embeddings"]))
        GSDRule(**{name: value for name, value in given.items() if name != "embeddings"})
    elif rule is not None:
        rule(**given)
    return takes


def acceptance_rule(ctx: MethodContext, accept: str = "coupled", **given: Any) -> AcceptanceRule | str:
    """The acceptance rule of a method: `accept` names the mode, `given` the parameters of its rule that a caller
    set (the rule's defaults apply to the rest). lossless (speculative sampling) and coupled (the target's own sample
    at every index: vanilla's tokens for the same generators) are exact (greedy at temperature 0); lantern is LANTERN
    over the VQ codebook's neighbours (its greedy variant at temperature 0); gsd is GSD's grouped rule (at
    temperature 0 p is one-hot and it reduces to greedy verification); capped is Lumina-mGPT 2.0's SJD code's
    speculative sampling with q capped at `cap` in the residual (lossy when p and q both exceed the cap)."""
    takes = check_accept(accept, given)
    if ACCEPT_RULES[accept] is None:  # an exact mode
        return ctx.params.exact_rule(accept)
    if accept == "capped":
        return CappedRule(**given)
    if accept == "lantern":
        k = min(int(given.pop("k", takes["k"])), ctx.pipeline.image_token_layout()[2] - 1)
        return LanternRule(ctx.neighbour_table(k), k=k, greedy=ctx.params.greedy, **given)
    return GSDRule(embeddings=ctx.token_embeddings(given.pop("embeddings", GSD_TABLE["embeddings"])), **given)


# ------------------------------------------------------------------------------------------------ drafters
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


def check_jacobi(window: Any = 16, init: Any = "random", interval: Any = None, coupling: Any = None) -> None:
    """The checks of `llamagen_jacobi_drafter`'s parameters that need no model (the window's and the interval's
    upper bounds need the image's token count); InputError on the first that fails."""
    check_positive_int("window", window)
    check_init(init)
    check_coupling(coupling)
    if interval != "reference":
        check_interval(interval)


def llamagen_jacobi_drafter(ctx: MethodContext, window: int = 16, init: str = "random",
                            interval: Any = None, coupling: str | None = None) -> JacobiDrafter:
    """A JacobiDrafter over the pipeline's VQ vocabulary: `window` positions re-sampled from the target every
    forward; init "random" (Lumina-mGPT setting) | "repeat_horizon" (LlamaGen t2i setting) | "sample_horizon";
    interval None (the whole image), "reference" or (start, end) image-token indices (a row drafts only when its
    next token index is >= start, never a token index >= end); coupling "none" (SJD's independent re-drafts),
    "gumbel" or "maximal" (MC-SJD: a re-drafted position keeps its token where its law barely changed;
    `mmspec.jacobi`), None = the rule's own (gumbel under the coupled rule, none otherwise). The image row width
    feeds the horizon inits; its randomness is the call's keyed noise (the loop's, from the user's generators);
    greedy tails at temperature 0."""
    check_jacobi(window, init, interval, coupling)
    block_size, row_width, vocab_size = ctx.pipeline.image_token_layout()
    # any window up to the image's length (or a short image's DRAFT_ROOM + 1): the target keeps room for it
    limit = max(block_size, DRAFT_ROOM + 1)
    check(window <= limit, f"window must be <= {limit} (the image's {block_size} tokens or {DRAFT_ROOM + 1}, whichever "
                           f"is larger), got {window}.")
    start, end = resolve_interval(interval, block_size, window)
    return JacobiDrafter(vocab_size, window, init, interval=(start, end), greedy=ctx.params.greedy,
                         row_width=row_width, init_tokens=ctx.pipeline.image_token_ids(),
                         coupling=check_coupling(coupling))


def eagle_tree_drafter(ctx: MethodContext, method: str, **tree: Any) -> EagleTreeDrafter:
    """The pipeline's eagle_drafter as the loop's EAGLE-2 tree drafter with `tree` = top_k, depth, total_tokens
    (defaults: `EagleTreeDrafter`'s), drafting with the target's CFG scale; InputError when there is none."""
    model = getattr(ctx.pipeline, "eagle_drafter", None)
    if model is None:
        raise InputError(f"method {method!r} needs a pipeline with an eagle_drafter component; {TRAIN_HINT}.")
    own = getattr(ctx.pipeline, "eagle_tree_drafter", None)  # a pipeline whose target is not LlamaGen's GPT
    if own is not None:
        return own(ctx.params, ctx.guidance_scale, layout=ctx.layout, **tree)
    return EagleTreeDrafter(model, ctx.pipeline.transformer, ctx.params, guidance_scale=ctx.guidance_scale, **tree)
