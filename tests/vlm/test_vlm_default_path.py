"""The VLM default path (`budget="auto"`, finished rows dropped) under every decision its budget can take, forced so
no outcome depends on the machine's speed (`mmspec.testing.budgets.forced_budget`): for every supported family and
every drafter kind, on a batch of 3 whose rows finish at different steps, the answers of `generate(**enc)` equal
transformers' own `model.generate(**enc)` token for token in calls that (1) settle on plain steps for the rest of the
call after the drafter's begin, the rows dropping after it settled (a budget that timed its shapes for the fewer rows
then ran the drafter on rows it no longer held), (2) draft the full tree, plain steps, a chain and a small tree in
turn while the rows held drop to one (the budget then times its shapes for one row, on the drafter's rows), and (3)
run without the drafter. Two rows end by their fifth token and the third runs to 48: whatever the drafts accept (at
most 9 tokens a step), the rows held drop to two and then to one while the third still runs."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from transformers import GenerationConfig

import mmspec.loop as loop
from mmspec.testing.budgets import CallScript, forced_budget
from vlm.family import DRAFTER_KINDS, drafter_model
from vlm.tiny import tiny_processor_batch, tiny_vlm

NEW_TOKENS = 48
TARGETS = [("llava", "llama"), ("llava", "qwen3"), ("llava", "gemma3_text"), ("qwen2_vl", "llama"),
           ("gemma3", "llama"), ("llava_next", "llama"), ("llava_onevision", "llama")]
SCRIPTS = (CallScript(settle_after=0),  # plain steps for the whole call, after the drafter's begin
           CallScript(steps=("full", "plain", "chain", "small", "plain")),  # every kind of step in turn
           CallScript(drafts=False))  # a call without the drafter


def finish_steps(rows: list[list[int]], eos: tuple[int, ...]) -> list[int | None]:
    """The step at which each row emits one of `eos` (None: never)."""
    return [next((i for i, t in enumerate(r) if t in eos), None) for r in rows]


def ragged_eos(rows: list[list[int]]) -> tuple[int, ...] | None:
    """One or two stop ids at which all rows but one finish, at different tokens up to the fifth (see the module
    docstring); None when no such ids exist."""
    for size in (1, 2):
        for eos in itertools.combinations(sorted({t for r in rows for t in r}), size):
            done = sorted(s for s in finish_steps(rows, eos) if s is not None)
            if len(done) == len(rows) - 1 and len(set(done)) == len(done) and done[-1] <= 4:
                return eos
    return None


@functools.cache
def ragged_seed(family: str, backbone: str) -> tuple[int, tuple[int, ...]]:
    """The first question seed whose batch of 3 has stop ids that end its rows at different steps, and those ids
    (deterministic: found once per target and reused by every drafter kind's test)."""
    vlm = tiny_vlm(family, backbone=backbone, peak=4.0)
    for seed in range(1, 17):
        enc = tiny_processor_batch(vlm, n=3, seed=seed)
        out = vlm.model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        eos = ragged_eos(out[:, enc["input_ids"].shape[1]:].tolist())
        if eos is not None:
            return seed, eos
    raise AssertionError(f"no batch of {family} whose rows finish at different steps")


def ragged_batch(family: str, backbone: str):
    """A tiny target of `family`, a left-padded batch of 3 questions and a GenerationConfig whose stop ids end the
    rows at different steps (`ragged_seed`)."""
    seed, eos = ragged_seed(family, backbone)
    vlm = tiny_vlm(family, backbone=backbone, peak=4.0)
    enc = tiny_processor_batch(vlm, n=3, seed=seed)
    pad = vlm.processor.tokenizer.pad_token_id
    return vlm, enc, GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=list(eos),
                                      pad_token_id=pad)


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("family,backbone", TARGETS)
def test_forced_budget_decisions_keep_transformers_tokens(family, backbone, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    vlm, enc, config = ragged_batch(family, backbone)
    reference = vlm.model.generate(**enc, generation_config=config)
    lengths = (reference[:, enc["input_ids"].shape[1]:] != config.pad_token_id).sum(-1)
    assert len(set(lengths.tolist())) == 3, lengths  # the rows end at three different steps
    torch.manual_seed(1)
    vlm.drafter = drafter_model(kind).for_target(vlm.lm).eval()
    drops, drop = [], loop.drop_finished_rows
    monkeypatch.setattr(loop, "drop_finished_rows", lambda state, *args, **kw: drops.append(
        state.batch_size) or drop(state, *args, **kw))
    # (a call without the drafter does not run it: one kind per target and every kind on the first target take it)
    scripts = SCRIPTS if kind == "eagle" or (family, backbone) == TARGETS[0] else SCRIPTS[:2]
    with forced_budget(*scripts) as budgets:
        for script in scripts:
            drops.clear()
            out = vlm.generate(**enc, generation_config=config)
            assert torch.equal(out, reference), (script, vlm.last_stats.extra)
            assert drops == [3, 2], drops  # rows left the batch twice in every call
    settled, varied, *without = budgets
    full = varied.full_key
    assert settled.choices == [0]  # settled at its first step, before the rows dropped
    assert {0, full} <= set(varied.choices) and any(s != 0 and s.top_k == 1 for s in varied.choices)
    if without:
        assert without[0].choices == []
        assert vlm.last_stats.extra.get("calls_without_drafter") == 1 and vlm.last_stats.num_drafts == 0


def test_forced_budget_decisions_keep_the_sampled_law(tmp_path, monkeypatch):
    """The embedded world LLaVA and its EAGLE drafter (trained: drafts get accepted) answer 400 copies of one question
    at temperature 2 on the default path, the drafted shape changing every step: the tokens at positions 1-5 (up to
    each row's <eos>), grouped by the tokens before them, fit the model's own softmax at temperature 2 (pooled
    chi-square); the same counts against temperature 1.6 must fail."""
    from vlm_dummies import appended_token_law

    from mmspec.data.artifacts import ASSETS_DIR
    from mmspec.testing.distributions import assert_fits_law_not_control, prefix_pairs
    from vlm.pipeline import SpeculativeVLM
    from vlm.world import world_vqa_examples

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    vlm = SpeculativeVLM.from_pretrained(ASSETS_DIR / "vlm", "eagle")
    example = world_vqa_examples("test", 1, seed=3)[0]
    n, temperature = 400, 2.0
    enc = vlm.processor(images=[example.image] * n, text=[vlm.prompt_text(example.qa.question + " Answer in detail.")]
                        * n, return_tensors="pt")
    with forced_budget(CallScript(steps=("full", "plain", "chain"))) as budgets:
        out = vlm.generate(**enc, max_new_tokens=6, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                           tree=(2, 2, 4), generator=torch.Generator().manual_seed(1))  # (a short menu to time)
    assert vlm.last_stats.num_accepted_tokens > n and len(set(budgets[0].choices)) == 3
    eos = vlm.processor.tokenizer.eos_token_id
    rows = [r[: r.index(eos) + 1] if eos in r else r for r in out[:, enc["input_ids"].shape[1]:].tolist()]
    pairs = prefix_pairs(rows, range(1, 6))
    assert_fits_law_not_control(pairs, lambda t: appended_token_law(vlm.model, enc, temperature * t), 0.8,
                                min_dof=4)


# (eagle3 runs EagleVLM's loop drafter; its sampled law is the method contract's, tests/test_contract.py)
SAMPLED_CASES = [("llava", "llama", kind) for kind in DRAFTER_KINDS if kind != "eagle3"] + [
    (family, backbone, "eagle") for family, backbone in TARGETS if (family, backbone) != ("llava", "llama")]


@pytest.mark.parametrize("family,backbone,kind", SAMPLED_CASES)
def test_sampled_default_path_gives_the_targets_own_answers(family, backbone, kind, tmp_path, monkeypatch):
    """At temperature 1 the default acceptance rule ("coupled") keeps the target's own sample at every token: under
    every forced budget decision the answers are the target alone's (`use_drafter=False`) for the same per-row
    generators, and a row answered alone (with the drafter) is its row of the batch."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    vlm = tiny_vlm(family, backbone=backbone, peak=4.0)
    enc = tiny_processor_batch(vlm, n=3, seed=2)
    torch.manual_seed(1)
    vlm.drafter = drafter_model(kind).for_target(vlm.lm).eval()
    sampled = dict(max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    def gens(seeds=(21, 22, 23)):
        return [torch.Generator().manual_seed(seed) for seed in seeds]

    alone = vlm.generate(**enc, **sampled, generator=gens(), use_drafter=False)
    with forced_budget(*SCRIPTS):
        for script in SCRIPTS:
            assert torch.equal(vlm.generate(**enc, **sampled, generator=gens()), alone), script
    assert vlm.last_stats.extra.get("calls_without_drafter") == 1
    vlm.generate(**enc, **sampled, generator=gens(), budget="fixed")
    assert vlm.last_stats.num_drafts > 0
    one = {k: v[1:2] for k, v in enc.items()} if family != "qwen2_vl" else None
    if one is not None:  # (Qwen2-VL's pixel rows are not one per question)
        row = vlm.generate(**one, **sampled, generator=gens((22,)))
        answer = alone[1, enc["input_ids"].shape[1]:]
        assert torch.equal(row[0, one["input_ids"].shape[1]:], answer[: row.shape[1] - one["input_ids"].shape[1]])
