"""The `toy` bench family: the toy causal LM target of `mmspec.testing.toy` and five drafting methods.

Models (built once): a randomly initialised `ToyTransformer` target (seeded by `--seed`) and a smaller draft
model made of the target's first `draft_layers` blocks with the target's embeddings and head (a truncated,
layer-skip style drafter: it agrees with the target often without any training). Inputs: `num_samples`
prompts of `prompt_length` random tokens from a generator seeded by `--seed`.

Methods (declared on the record `FAMILY`; all lossless; greedy rule at temperature 0, the lossless
rejection-sampling rule above 0):

- `vanilla`: `NoDrafter`, one target forward per token (the reference).
- `draft-model`: `DraftModelDrafter` with the truncated draft model, `k` tokens per step.
- `self-draft`: the target drafting for itself (`DraftModelDrafter(target)`): an upper bound on acceptance.
- `tree`: `TreeModelDrafter` (EAGLE-2 dynamic tree) scored by the truncated draft model.
- `random`: `RandomDrafter`, uniformly random drafts (a lower bound: almost nothing is accepted).

Quality: `exactness` = fraction of samples whose tokens equal vanilla's token for token (temperature 0);
'n/a (sampling)' above temperature 0, where lossless methods match vanilla in distribution, not per sample, and
the token calibration figures test that instead (`pit_ks`, its p-value...: `mmspec.metrics.calibration`, scored
by a teacher-forced target pass over each prompt and its generated tokens).
Family options (`--family-option KEY=VALUE`): vocab_size, dim, num_layers, num_heads, draft_layers,
prompt_length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.bench.registry import BenchSettings, Family, Method, MethodOutput, Sample, methods_of
from mmspec.errors import InputError, check, check_positive_int
from mmspec.families import FamilyRecord
from mmspec.lm import DraftModelDrafter, GuidedRunner, LMTarget, NoDrafter, TreeModelDrafter, teacher_forced_probs
from mmspec.lookup import PromptLookupDrafter, SuffixLookupDrafter
from mmspec.loop import Drafter, generate
from mmspec.sampling import SamplingParams
from mmspec.testing.drafters import RandomDrafter
from mmspec.testing.toy import ToyTransformer, toy_model

TOY_OPTIONS: dict[str, int] = {"vocab_size": 64, "dim": 64, "num_layers": 4, "num_heads": 4, "draft_layers": 1,
                               "prompt_length": 8}
MAX_DRAFT = 64  # longest chain / deepest tree a configuration may ask for (sizes the position table)
NOT_APPLICABLE_SAMPLING = "n/a (sampling)"


@dataclass
class ToyModels:
    """The models every toy method shares."""

    target: ToyTransformer
    draft: ToyTransformer  # the target's first `draft_layers` blocks, sharing its embeddings and head
    options: dict[str, int]

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size


def toy_options(settings: BenchSettings) -> dict[str, int]:
    """TOY_OPTIONS overridden by `settings.options` (integers); InputError on unknown keys or bad values."""
    options = dict(TOY_OPTIONS)
    for key, value in settings.options.items():
        if key not in TOY_OPTIONS:
            raise InputError(f"unknown option {key!r} for bench family 'toy'; known: {', '.join(TOY_OPTIONS)}.")
        try:
            options[key] = int(value)
        except (TypeError, ValueError):
            raise InputError(f"toy option {key} must be an integer, got {value!r}.") from None
        check_positive_int(key, options[key])
    check(options["dim"] % options["num_heads"] == 0,
          f"toy option dim ({options['dim']}) must be divisible by num_heads ({options['num_heads']}).")
    check(options["draft_layers"] <= options["num_layers"],
          f"toy option draft_layers ({options['draft_layers']}) must be <= num_layers ({options['num_layers']}).")
    return options


def truncated_model(model: ToyTransformer, num_layers: int) -> ToyTransformer:
    """A ToyTransformer running the first `num_layers` blocks of `model` (weights shared, not copied)."""
    small = ToyTransformer(vocab_size=model.vocab_size, dim=model.tok.embedding_dim, num_layers=num_layers,
                           num_heads=model.num_heads, max_positions=model.pos.num_embeddings,
                           attention_backend=model.attention_backend)
    small.tok, small.pos, small.norm, small.head = model.tok, model.pos, model.norm, model.head
    small.blocks = torch.nn.ModuleList(list(model.blocks[:num_layers]))
    return small.to(model.head.weight.device).eval()


def build_toy(settings: BenchSettings) -> ToyModels:
    """The seeded target and its truncated draft model on `settings.device`."""
    o = toy_options(settings)
    max_positions = o["prompt_length"] + settings.max_new_tokens + MAX_DRAFT + 2
    target = toy_model(seed=settings.seed, vocab_size=o["vocab_size"], dim=o["dim"], num_layers=o["num_layers"],
                       num_heads=o["num_heads"], max_positions=max_positions).to(settings.device)
    return ToyModels(target=target, draft=truncated_model(target, o["draft_layers"]), options=o)


def toy_inputs(settings: BenchSettings) -> list[Sample]:
    """`num_samples` random prompts [prompt_length] from a generator seeded by `settings.seed`."""
    o = toy_options(settings)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    prompts = torch.randint(0, o["vocab_size"], (settings.num_samples, o["prompt_length"]), generator=generator)
    return [Sample(question_id=i, category="toy", data=prompts[i]) for i in range(settings.num_samples)]


def _row_generators(batch: Sequence[Sample], settings: BenchSettings, stream: int) -> list[torch.Generator] | None:
    """One generator per row, seeded by (seed, stream, question id): a row's randomness ignores its batch."""
    if settings.greedy:
        return None
    return [torch.Generator(device=settings.device).manual_seed(
        settings.seed * 1_000_003 + stream * 10_007 + int(s.question_id)) for s in batch]


def _params(settings: BenchSettings) -> SamplingParams:
    return SamplingParams(temperature=settings.temperature)


def draft_nodes(drafter: Drafter) -> int:
    """Positions one verify call scores: total_tokens for a tree, K + 1 for a chain of K, 1 for NoDrafter."""
    return int(getattr(drafter, "total", None) or getattr(drafter, "k", 0) + 1)


def decode(models: ToyModels, batch: Sequence[Sample], settings: BenchSettings, drafter: Drafter,
           rule: str) -> MethodOutput:
    """Run the loop on one batch; outputs are the generated token ids per sample ([n] int64 each).

    The target's cache gets room for twice `draft_nodes` past max_new_tokens: a row that finishes with accepted
    drafts beyond its last kept token is still run (inactive) while other rows of the batch go on.
    """
    prompts = torch.stack([s.data for s in batch]).to(settings.device)  # [B, P]
    target = LMTarget(models.target, _params(settings), settings.max_new_tokens,
                      max_draft_nodes=2 * draft_nodes(drafter))
    out = generate(target, drafter, rule, prompts, batch_size=len(batch), max_new_tokens=settings.max_new_tokens,
                   generator=_row_generators(batch, settings, stream=0), device=settings.device)
    counts = out.num_generated.tolist()
    return MethodOutput(outputs=[out.tokens[r, :n] for r, n in enumerate(counts)], new_tokens=counts,
                        stats=out.stats)


def _check_draft_size(name: str, value: Any) -> None:
    check_positive_int(name, value)
    check(value <= MAX_DRAFT, f"{name} must be <= {MAX_DRAFT} for the toy family, got {value}.")


@dataclass
class ToyRun:
    """What a toy method runs on: the shared models, one batch of samples and the bench settings."""

    models: ToyModels
    batch: Sequence[Sample]
    settings: BenchSettings


FAMILY = FamilyRecord("toy", "toy causal LM target (mmspec.testing.toy) with chain, tree, self and random drafters",
                      bench=lambda: toy_family())


def exact_rule(run: ToyRun) -> str:
    return "greedy" if run.settings.greedy else "lossless"


@FAMILY.method()
def vanilla(run: ToyRun) -> tuple[Drafter, str]:
    """NoDrafter: one target forward per token."""
    return NoDrafter(), exact_rule(run)


def _chain(run: ToyRun, model: ToyTransformer, k: int) -> tuple[Drafter, str]:
    _check_draft_size("k", k)
    return DraftModelDrafter(model, k, _params(run.settings)), exact_rule(run)


@FAMILY.method()
def draft_model(run: ToyRun, k: int = 4) -> tuple[Drafter, str]:
    """DraftModelDrafter with the truncated (draft_layers) model."""
    return _chain(run, run.models.draft, k)


@FAMILY.method()
def self_draft(run: ToyRun, k: int = 4) -> tuple[Drafter, str]:
    """The target drafts for itself (upper bound)."""
    return _chain(run, run.models.target, k)


@FAMILY.method(params=(TreeModelDrafter,), skip=("guidance_scale", "prefill_fn"))
def tree(run: ToyRun, **given: Any) -> tuple[Drafter, str]:
    """TreeModelDrafter (EAGLE-2 dynamic tree) with the truncated model."""
    drafter = TreeModelDrafter(run.models.draft, **given)
    _check_draft_size("depth", drafter.depth)
    check_positive_int("total_tokens", drafter.total, minimum=2)
    return drafter, exact_rule(run)


@FAMILY.method(params=(PromptLookupDrafter,), skip=("banned_tokens",))
def pld(run: ToyRun, **given: Any) -> tuple[Drafter, str]:
    """Prompt lookup: the tokens that followed the last n-gram's earlier occurrence in the row (no model)."""
    drafter = PromptLookupDrafter(**given)
    _check_draft_size("num_draft_tokens", drafter.k)
    return drafter, exact_rule(run)


@FAMILY.method(params=(PromptLookupDrafter,), skip=("banned_tokens", "max_ngram"))
def sam(run: ToyRun, **given: Any) -> tuple[Drafter, str]:
    """SAM decoding: prompt lookup of the longest repeated suffix through a suffix automaton per row (no model)."""
    drafter = SuffixLookupDrafter(**given)
    _check_draft_size("num_draft_tokens", drafter.k)
    return drafter, exact_rule(run)


@FAMILY.method()
def random(run: ToyRun, k: int = 4) -> tuple[Drafter, str]:
    """RandomDrafter (lower bound)."""
    _check_draft_size("k", k)
    drafter = RandomDrafter(run.models.vocab_size, k, seed=run.settings.seed + int(run.batch[0].question_id),
                            ragged=False)
    return drafter, exact_rule(run)


def exactness(outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """Fraction of samples whose token ids equal the reference's, token for token."""
    check(len(outputs) == len(reference), f"{len(outputs)} outputs but {len(reference)} reference outputs.")
    return sum(bool(torch.equal(a, b)) for a, b in zip(outputs, reference)) / max(len(outputs), 1)


def toy_quality(method: Method, params: Mapping[str, Any], outputs: Sequence[torch.Tensor],
                reference: Sequence[torch.Tensor], settings: BenchSettings) -> dict[str, float | str]:
    """Exactness vs vanilla at temperature 0; 'n/a (sampling)' above it."""
    if not settings.greedy:
        return {"exactness": NOT_APPLICABLE_SAMPLING}
    return {"exactness": exactness(outputs, reference)}


def toy_calibration(models: ToyModels, samples: Sequence[Sample], outputs: Sequence[torch.Tensor],
                    settings: BenchSettings) -> dict:
    """Token calibration of sampled outputs under the target given their samples' prompts (empty at temperature
    0); rows of equal length are scored together."""
    from mmspec.metrics.calibration import calibration_figures

    if settings.greedy:
        return {}
    prompts = [s.data for s in samples]

    def scored():
        for length in sorted({int(o.numel()) for o in outputs if o.numel() > 0}):
            rows = [i for i, o in enumerate(outputs) if o.numel() == length]
            tokens = torch.stack([outputs[i] for i in rows]).to(settings.device)  # [n, length]
            prompt = torch.stack([prompts[i] for i in rows]).to(settings.device)  # [n, P]
            yield teacher_forced_probs(GuidedRunner(models.target), prompt, tokens, _params(settings)), tokens

    return calibration_figures(scored(), settings.seed)


def toy_model_id(settings: BenchSettings) -> str:
    o = toy_options(settings)
    return f"toy-v{o['vocab_size']}-d{o['dim']}-l{o['num_layers']}"


def toy_family() -> Family:
    """The toy family's bench view (cheap: models are built by `Family.build`)."""

    def runner(record):
        def run(models: ToyModels, batch: Sequence[Sample], settings: BenchSettings, given: dict) -> MethodOutput:
            drafter, rule = record.build(ToyRun(models, batch, settings), given, "toy")
            return decode(models, batch, settings, drafter, rule)

        return run

    return Family(name="toy", model_id=toy_model_id, build=build_toy, inputs=toy_inputs, quality=toy_quality,
                  primary_quality="exactness", to_turn=lambda tokens: tokens.tolist(), model_quality=toy_calibration,
                  description=FAMILY.description, methods=methods_of(FAMILY, runner))
