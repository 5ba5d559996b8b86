"""What the class-conditional image bench families (llamagen, var) share: their family options, the class-label
inputs, per-image generators, the judge-based quality figures and the token calibration figures.

Family options (`--family-option KEY=VALUE`): model (pipeline folder; default the embedded asset),
guidance_scale, top_k, top_p (defaults: the family's pipeline defaults), fid_reference (number of held-out real
world images for world-FID, default 2000), compile (a `torch.compile` mode for the pipeline's step forwards,
e.g. `compile=default` or `compile=reduce-overhead`; off by default; `mmspec.compile`). A family may accept options
of its own on top (`extra`: LlamaGen's `budget`, the pipeline's draft budget `fixed` or `auto`, `mmspec.budget`);
among them `decode` (true or false: false times the generation alone, no image decoded), `size` (an official size
with random weights, which cannot go with `model`) and `logit_scale` (a positive number) are checked here, and with
`size` or decode=false the quality figures are the tokens' alone (`tokens_only`, `token_figures`);
`check_official_only` refuses the options only an official size takes when `size` is not given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from mmspec.bench.registry import BenchSettings, Sample
from mmspec.compile import check_compile_mode
from mmspec.errors import InputError, check

OPTIONS = ("model", "guidance_scale", "top_k", "top_p", "fid_reference", "compile")


def image_options(settings: BenchSettings, family: str, defaults: Mapping[str, Any],
                  extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The family options of a run, parsed, with the pipeline defaults filled in; the family's own `extra` options
    are passed through as text (None when not given)."""
    unknown = set(settings.options) - set(OPTIONS) - set(extra)
    if unknown:
        raise InputError(f"unknown option(s) {sorted(unknown)} for bench family {family!r}; "
                         f"known: {', '.join((*OPTIONS, *extra))}.")
    o = dict(settings.options)
    if "compile" in o:  # before the pipeline loads
        check_compile_mode(o["compile"], " (--family-option compile=...)", auto=True)
    check(o.get("decode") in (None, "true", "false"),
          f"--family-option decode must be true or false, got {o.get('decode')!r}.")
    check(o.get("size") is None or o.get("model") is None,
          "--family-option size builds an official size with random weights; it cannot go with model=PATH.")
    scale = o.get("logit_scale")
    check(scale is None or (scale.replace(".", "", 1).isdigit() and float(scale) > 0),
          f"--family-option logit_scale must be a positive number, got {scale!r}.")
    guidance = o.get("guidance_scale", defaults["guidance_scale"])  # None: the pipeline's own default
    top_k = o.get("top_k", defaults["top_k"])  # None: the pipeline's own default
    return {"model": o.get("model"), "guidance_scale": None if guidance is None else float(guidance),
            "top_k": None if top_k is None else int(top_k), "top_p": float(o.get("top_p", defaults["top_p"])),
            "fid_reference": int(o.get("fid_reference", 2000)), "compile": o.get("compile"),
            **{key: o.get(key) for key in extra}}


def class_inputs(settings: BenchSettings) -> list[Sample]:
    """num_samples class labels cycling through the world's classes."""
    from mmspec.data import CLASS_NAMES

    n_classes = len(CLASS_NAMES)
    return [Sample(question_id=i, category=CLASS_NAMES[i % n_classes], data=i % n_classes)
            for i in range(settings.num_samples)]


def sample_generators(batch: Sequence[Sample], settings: BenchSettings) -> list[torch.Generator]:
    """One generator per image seeded by (seed, sample id): a sample's randomness does not depend on its batch."""
    return [torch.Generator(device=settings.device).manual_seed(settings.seed * 1_000_003 + int(s.question_id))
            for s in batch]


def image_outputs(images: torch.Tensor, tokens: torch.Tensor, batch: Sequence[Sample]) -> list[dict]:
    """One output per sample: its image, tokens, condition ("label": a class id or a caption) and sample id."""
    return [{"image": img.cpu(), "tokens": tok.cpu(), "label": s.data if isinstance(s.data, str) else int(s.data),
             "index": s.question_id} for img, tok, s in zip(images, tokens, batch)]


def run_image_method(pipe: Any, conditions: Mapping[str, Any], batch: Sequence[Sample], settings: BenchSettings,
                     options: Mapping[str, Any], method: str, given: Mapping[str, Any], budget: str | None,
                     output_type: str = "pt"):
    """One bench batch of an image pipeline: `pipe(**conditions, ...)` with the run's sampling options, the
    method and its parameters, one generator per sample (`output_type` "latent": no image decoding, the outputs'
    "image" holds the tokens); returns the bench's MethodOutput."""
    from mmspec.bench.registry import MethodOutput

    out = pipe(**conditions, generator=sample_generators(batch, settings), guidance_scale=options["guidance_scale"],
               temperature=settings.temperature, top_k=options["top_k"], top_p=options["top_p"], method=method,
               method_kwargs=dict(given), output_type=output_type, budget=budget)
    return MethodOutput(outputs=image_outputs(out.images, out.tokens, batch),
                        new_tokens=[out.tokens.shape[1]] * len(batch), stats=out.stats)


@lru_cache(maxsize=4)
def _reference(n: int):
    from mmspec.metrics import world_reference_stats

    return world_reference_stats(n=n, seed=0)


def image_quality(outputs: Sequence[dict], vanilla: Sequence[dict], settings: BenchSettings,
                  fid_reference: int, exactness: bool) -> dict:
    """Judge class accuracy, world-FID (2+ images), and token exactness vs vanilla when `exactness`."""
    from mmspec.metrics import class_accuracy, world_fid

    images = torch.stack([o["image"] for o in outputs])
    labels = torch.tensor([o["label"] for o in outputs])
    figures: dict[str, Any] = {"class_accuracy": class_accuracy(images, labels)}
    if len(outputs) >= 2:
        fid = world_fid(images, _reference(fid_reference))
        figures["world_fid"] = fid.fid
        figures["world_fid_n"] = fid.n_generated
    if exactness:
        figures["exactness"] = token_exactness(outputs, vanilla)
    return figures


def reproduces_vanilla(method: Any, params: Mapping[str, Any], settings: BenchSettings) -> bool:
    """Whether a method's tokens must equal vanilla's for the same samples: a lossless method at temperature 0, or
    the coupled acceptance mode at any temperature (vanilla's own sample, `mmspec.verify.coupled`)."""
    return method.is_lossless(params) and (settings.greedy or params.get("accept") == "coupled")


def check_official_only(options: Mapping[str, Any], keys: Sequence[str], sizes: str) -> None:
    """InputError (one line) for an option of `keys` that only an official size takes, given without `size`."""
    for key in keys:
        check(options.get(key) is None or options.get("size") is not None,
              f"--family-option {key} applies to an official size: give size={sizes} as well.")


def tokens_only(options: Mapping[str, Any]) -> bool:
    """Whether a run's quality is its tokens' alone: an official size with random weights, or no images decoded."""
    return options.get("size") is not None or options.get("decode") == "false"


def token_figures(outputs: Sequence[dict], vanilla: Sequence[dict], exact: bool) -> dict:
    """The quality of a `tokens_only` run: token exactness versus vanilla where the tokens must equal vanilla's."""
    return {"exactness": token_exactness(outputs, vanilla)} if exact else {}


def token_exactness(outputs: Sequence[dict], vanilla: Sequence[dict]) -> float:
    """The share of outputs whose tokens equal vanilla's for the same sample."""
    same = [torch.equal(a["tokens"], b["tokens"]) for a, b in zip(outputs, vanilla)]
    return sum(same) / len(same)


# score(class_labels, tokens [N, T]) -> the target's sampling distributions [N, T, V] at every token
TokenScorer = Callable[[list[int], torch.Tensor], torch.Tensor]


def token_calibration(score: TokenScorer, outputs: Sequence[dict], settings: BenchSettings,
                      batch_size: int = 32) -> dict:
    """How closely the outputs' tokens follow the target (`mmspec.metrics.calibration`: pit_ks, its p-value,
    excess surprisal, off-support rate), scored `batch_size` images at a time. Empty at temperature 0, where the
    target's distribution is a point mass and the measure says nothing."""
    from mmspec.metrics.calibration import calibration_figures

    if settings.greedy:
        return {}

    def scored():
        for start in range(0, len(outputs), batch_size):
            chunk = outputs[start:start + batch_size]
            tokens = torch.stack([o["tokens"] for o in chunk])  # [n, T]
            yield score([o["label"] for o in chunk], tokens), tokens  # p [n, T, V]

    return calibration_figures(scored(), settings.seed)
