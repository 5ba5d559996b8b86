"""A VLM batch drops its finished answers (`mmspec.loop.generate(drop_finished=True)`, the pipeline's default):
every answer, every row's accept lengths and the streamed pieces are those of the same batch kept whole, for vanilla
and every drafter kind, fixed and auto budgets; the rows do leave (later steps run fewer rows), and an auto budget
prices the fewer rows with shape times of their own."""


import pytest
import torch

import mmspec.loop as loop
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.testing.budgets import CallScript, forced_budget
from vlm.family import DRAFTER_KINDS
from vlm.pipeline import SpeculativeVLM
from vlm.world import world_vqa_examples

FOLDER = ASSETS_DIR / "vlm"


@pytest.fixture(scope="module")
def questions():
    """Short and long answers mixed (the world's default), so the rows of a batch end at different steps."""
    examples = world_vqa_examples("test", 8, seed=3)
    return [ex.image for ex in examples], [ex.prompt for ex in examples]


@pytest.fixture
def drops(monkeypatch):
    """The rows each drop keeps, as the loop drops them."""
    seen = []
    original = loop.drop_finished_rows

    def counted(state, target, drafter, active, drafts):
        seen.append(int(active.sum()))
        return original(state, target, drafter, active, drafts)

    monkeypatch.setattr(loop, "drop_finished_rows", counted)
    return seen


def answers(vlm: SpeculativeVLM, questions, drop: bool, **kwargs):
    vlm.drop_finished = drop
    streamed = []
    out = vlm.generate(*questions, max_new_tokens=48, batch_size=8, temperature=0.0,
                       stream=lambda row, text, ids: streamed.append((row, tuple(ids))), **kwargs)
    return out.token_ids, out.stats.accept_lengths_per_row(), streamed


def per_row(streamed) -> list[tuple[int, ...]]:
    """Streamed (row, ids) pieces -> each row's tokens, in the order streamed."""
    rows = {}
    for row, ids in streamed:
        rows[row] = rows.get(row, ()) + ids
    return [rows[row] for row in sorted(rows)]


@pytest.mark.parametrize("kind", [None, *DRAFTER_KINDS])
def test_dropping_finished_rows_keeps_every_answer(kind, questions, drops, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    vlm = SpeculativeVLM.from_pretrained(FOLDER, kind)
    options = [{"use_drafter": False}] if kind is None else [{"budget": "fixed", "tree": (6, 1, 7)}]
    if kind in ("eagle", "vispec"):  # (ViSpec keeps a per-row image feature of its own)
        options.append({"budget": "auto"})
    for kwargs in options:
        kept = answers(vlm, questions, drop=False, **kwargs)
        assert drops == [], kwargs
        dropped = answers(vlm, questions, drop=True, **kwargs)
        assert drops and max(drops) < 8, (kwargs, drops)  # rows left the batch ..
        if kwargs.get("budget") == "auto":  # (its step sizes follow measured times: the answers are what must agree)
            assert dropped[0] == kept[0], kwargs
            assert per_row(dropped[2]) == per_row(kept[2]) == [tuple(ids) for ids in kept[0]]
        else:  # every answer, accept length and streamed piece stayed the same
            assert dropped == kept, kwargs
        drops.clear()
    lengths = [len(ids) for ids in kept[0]]
    assert min(lengths) < max(lengths)  # (a batch whose rows end at different steps)


def test_an_auto_budget_follows_the_rows_it_holds(questions, drops, tmp_path, monkeypatch):
    """The budget times its options once, at the call's batch size, and keeps timing its steps after the loop drops
    finished rows (the step across a drop is not timed); the call's batch size keys it as before. The budget
    drafts every step (forced), so it makes choices at every row count the call reaches."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    vlm = SpeculativeVLM.from_pretrained(FOLDER, "eagle")
    with forced_budget(CallScript(steps=("full", "chain"))):
        vlm.generate(*questions, max_new_tokens=48, batch_size=8, temperature=0.0, budget="auto")
    (budget,) = vlm.budgets.values()
    assert drops and len(budget.costs.table) == len(budget.options)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1  # one table: the call's batch size
    assert budget.costs.steps and budget._rows_held == min(drops)  # it priced the last rows held


def test_sampled_rows_with_their_own_generators_do_not_depend_on_dropping(drops):
    """Sampling with a generator per row: each row draws from its own stream whatever rows are held, so the sampled
    answers are the same with and without dropping (a single generator for the batch would be consumed in another
    order; the law is the same either way)."""
    vlm = SpeculativeVLM.from_pretrained(FOLDER, "eagle")
    examples = world_vqa_examples("test", 6, seed=5)
    images, prompts = [ex.image for ex in examples], [ex.prompt for ex in examples]
    runs = []
    for drop in (False, True):
        vlm.drop_finished = drop
        generators = [torch.Generator().manual_seed(i) for i in range(6)]
        out = vlm.generate(images, prompts, max_new_tokens=32, batch_size=6, temperature=1.0, generator=generators,
                           budget="fixed", tree=(4, 1, 5))
        runs.append(out.token_ids)
    assert drops and runs[0] == runs[1]
    assert len({len(ids) for ids in runs[0]}) > 1  # rows ended at different steps


def test_qwen2_vl_rows_keep_their_rope_deltas(drops, questions):
    """Qwen2-VL's target keeps each row's M-RoPE delta for its steps: a dropped batch keeps the rows' own."""
    vlm = SpeculativeVLM.from_pretrained(ASSETS_DIR / "vlm-qwen2", "eagle")
    for kwargs in ({"use_drafter": False}, {"budget": "fixed", "tree": (6, 1, 7)}):
        kept = answers(vlm, questions, drop=False, **kwargs)
        dropped = answers(vlm, questions, drop=True, **kwargs)
        assert drops and dropped == kept, kwargs
        drops.clear()


def test_the_bench_family_mixes_answers_and_keeps_rows_on_request():
    """`--family-option long_fraction=0.5` asks the world's own mix of one-word and long answers, `drop_finished=
    false` keeps every row to the end (transformers' way); bad values are one-line errors."""
    from mmspec.bench.registry import BenchSettings
    from mmspec.errors import InputError
    from vlm.bench import _options, inputs

    def prompts(**options):
        return [s.data.prompt for s in inputs(BenchSettings(num_samples=16, options=options))]

    assert len(set(prompts())) < len(set(prompts(long_fraction="0.5")) | set(prompts()))
    assert _options(BenchSettings())["drop_finished"] and not _options(
        BenchSettings(options={"drop_finished": "false"}))["drop_finished"]
    for bad in ({"long_fraction": "2"}, {"drop_finished": "maybe"}):
        with pytest.raises(InputError):
            _options(BenchSettings(options=bad))
