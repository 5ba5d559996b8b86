"""`mmspec bench`: a small interleaved toy run end to end, the run order, records, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmspec.bench import (
    BenchSettings,
    Family,
    Method,
    MethodOutput,
    Sample,
    get_family,
    parse_method_list,
    plan_steps,
    register_family,
    run_bench,
    unregister_family,
)
from mmspec.bench.records import CHOICE_FIELDS, MMSPEC_FIELDS, SPEC_BENCH_FIELDS
from mmspec.bench.runner import round_order
from mmspec.cli import main
from mmspec.errors import InputError
from mmspec.stats import SpecStats

TOY_METHODS = ["vanilla", "draft-model", "self-draft", "tree", "pld", "sam", "random"]
# one torch thread: on a loaded 2-core machine two intra-op threads make this tiny model 10x slower
SMALL_TOY = ["--threads", "1", "--family-option", "dim=16", "--family-option", "num_layers=2",
             "--family-option", "num_heads=2", "--family-option", "vocab_size=32"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """One small CLI run: batch sizes 1 and 2 over 3 samples (the last batch of size 2 is ragged)."""
    out = tmp_path_factory.mktemp("bench") / "toy"
    argv = ["bench", "--family", "toy", "--batch-sizes", "1,2", "--warmup", "1", "--repeats", "2",
            "--num-samples", "3", "--max-new-tokens", "10", "--temperature", "0", "--device", "cpu",
            "--quiet", *SMALL_TOY, "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return out, records, summary


def rows_by_method(summary, batch_size):
    table = next(t for t in summary["batch_sizes"] if t["batch_size"] == batch_size)
    return {row["method"]: row for row in table["methods"]}


def test_files_exist_and_plots_are_valid_pngs(toy_run):
    out, _, _ = toy_run
    names = {p.name for p in out.iterdir()}
    assert {"results.jsonl", "summary.md", "summary.json"} <= names
    assert not [n for n in names if n.endswith(".tmp")]  # atomic writes leave no temporaries
    for b in (1, 2):
        for stem in ("speedup_vs_quality", "acceptance_per_position", "acceptance_histogram"):
            path = out / f"{stem}_bs{b}.png"
            assert path.read_bytes()[:8] == PNG_MAGIC
            with Image.open(path) as image:
                image.verify()


def test_records_carry_every_spec_bench_field(toy_run):
    _, records, _ = toy_run
    assert len(records) == len(TOY_METHODS) * 2 * 2 * 3  # methods x batch sizes x repeats x samples
    for r in records:
        assert set(SPEC_BENCH_FIELDS) | set(MMSPEC_FIELDS) <= set(r)
        (choice,) = r["choices"]
        assert set(CHOICE_FIELDS) <= set(choice)
        assert len(choice["turns"]) == len(choice["decoding_steps"]) == len(choice["new_tokens"]) == 1
        assert len(choice["wall_time"]) == 1 and choice["wall_time"][0] > 0
        assert choice["new_tokens"][0] == len(choice["turns"][0]) == 10
        assert choice["decoding_steps"][0] == r["nfe"] >= 1
        assert sum(choice["accept_lengths"]) >= choice["new_tokens"][0] - 1  # first token comes from prefill
        assert r["peak_memory_bytes"] > 0 and r["memory_kind"] == "cpu_peak_rss"
        assert r["method"] in TOY_METHODS and r["batch_size"] in (1, 2) and r["repeat"] in (0, 1)
        assert r["model_id"].endswith("-" + r["method"])
    assert len({r["answer_id"] for r in records}) == len(records)
    # within a batch every sample carries the batch's NFE and the same share of its wall time
    pairs = [r for r in records if r["batch_size"] == 2 and r["question_id"] in (0, 1)]
    for method in TOY_METHODS:
        a, b = [r for r in pairs if r["method"] == method and r["repeat"] == 0]
        assert a["nfe"] == b["nfe"] and a["choices"][0]["wall_time"] == b["choices"][0]["wall_time"]


def test_greedy_lossless_methods_are_exact_and_vanilla_is_the_unit(toy_run):
    _, records, summary = toy_run
    assert all(r["lossless"] and r["quality"] == {"exactness": 1.0} for r in records)
    vanilla_turns = {(r["batch_size"], r["repeat"], r["question_id"]): r["choices"][0]["turns"]
                     for r in records if r["method"] == "vanilla"}
    for r in records:
        assert r["choices"][0]["turns"] == vanilla_turns[(r["batch_size"], r["repeat"], r["question_id"])]
    for b in (1, 2):
        rows = rows_by_method(summary, b)
        assert list(rows) == TOY_METHODS
        assert rows["vanilla"]["step_compression"] == 1.0 and rows["vanilla"]["mean_acceptance_length"] == 1.0
        assert rows["vanilla"]["draft_acceptance_rate"] is None
        assert rows["self-draft"]["step_compression"] > 1 and rows["self-draft"]["mean_acceptance_length"] > 1
        assert rows["self-draft"]["draft_acceptance_rate"] == 1.0
        for row in rows.values():
            sp = row["speedup"]
            assert 0 < sp["min"] <= sp["median"] <= sp["max"] and len(sp["per_repeat"]) == 2
            assert row["quality"] == {"exactness": 1.0} and row["peak_memory_bytes"] > 0
        assert rows["vanilla"]["speedup"]["per_repeat"] == [1.0, 1.0]


def test_summary_markdown_has_a_row_per_method_and_batch_size(toy_run):
    out, _, _ = toy_run
    text = (out / "summary.md").read_text()
    sections = re.split(r"^## Batch size ", text, flags=re.M)[1:]
    assert [s.split("\n", 1)[0] for s in sections] == ["1", "2"]
    for section in sections:
        methods = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")]
        assert methods[1:] == TOY_METHODS  # first row is the header
        assert "](speedup_vs_quality_bs" in section
    assert "mmspec bench --family toy" in text


def test_cli_prints_the_table(tmp_path, capsys):
    out = tmp_path / "printed"
    argv = ["bench", "--methods", "self-draft", "--num-samples", "2", "--max-new-tokens", "4", "--repeats", "1",
            "--warmup", "0", "--no-plots", "--device", "cpu", *SMALL_TOY, "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| vanilla |" in printed and "| self-draft |" in printed and "speed-up" in printed
    assert not list(out.glob("*.png"))


def test_table_heading_says_the_new_tokens_each_sample_got():
    """The heading reads vanilla's tokens a sample: an image family ignores --max-new-tokens (a 16x16-token model
    makes 256 whatever the cap), a VLM's rows stop at EOS; the cap alone only when they agree."""
    from mmspec.bench.report import new_tokens_heading

    settings = {"max_new_tokens": 64, "num_samples": 4}
    rows = [{"method": "sjd", "new_tokens": 1024.0}, {"method": "vanilla", "new_tokens": 1024.0}]
    assert new_tokens_heading(rows, settings) == "256 new tokens a sample (--max-new-tokens 64)"
    assert new_tokens_heading([{"method": "vanilla", "new_tokens": 256.0}], settings) == "64 new tokens"
    assert new_tokens_heading([{"method": "vanilla", "new_tokens": 250.0}], settings).startswith("62.5 new tokens")
    assert new_tokens_heading([{"method": "sjd", "new_tokens": 256.0}], settings) == "max 64 new tokens"


def test_gate_log_shows_what_each_budget_did(tmp_path, caplog, capsys):
    """`--gate-log` turns the budgets' DEBUG lines on (stderr): each configuration's batch as it starts and, after
    each drafted call, the options chosen with their step seconds and expected tokens, and the gate's calls."""
    from mmspec.budget import BudgetConfig, ThroughputBudget
    from mmspec.loop import DecodeState
    from mmspec.tree import chain

    loggers = [logging.getLogger(name) for name in ("mmspec.budget", "mmspec.bench.runner")]
    argv = ["bench", "--methods", "self-draft", "--num-samples", "2", "--max-new-tokens", "4", "--repeats", "1",
            "--warmup", "0", "--no-plots", "--quiet", "--device", "cpu", *SMALL_TOY, "--out", str(tmp_path / "g"),
            "--gate-log"]
    try:
        assert main(argv) == 0
        assert "mmspec.bench.runner: self-draft at batch size 1" in capsys.readouterr().err
        for logger in loggers:
            assert logger.level == logging.DEBUG and any(getattr(h, "gate_verdicts", False) for h in logger.handlers)
        budget = ThroughputBudget([chain(k) for k in range(3)], [0, 1, 2], BudgetConfig(warmup=1, timing=False),
                                  costs=[1.0, 1.5, 2.0])
        with caplog.at_level(logging.DEBUG, logger="mmspec.budget"):
            budget.begin(None, None, DecodeState.new(1, 4, "cpu"), "lossless")
            budget.choose(1, lambda: torch.tensor([4])), budget.choose(1, lambda: torch.tensor([4]))
            budget.end()
        (line,) = [r.getMessage() for r in caplog.records if r.name == "mmspec.budget"]
        assert line.startswith("budget: 0 x1 (1000.00 ms, 1.00/1.00/1.00/1.00 tok), chain2 x1 (2000.00 ms, "
                               "1.75/1.75/1.75/1.75 tok); calls")  # (expected tokens in each segment of a call)
    finally:
        for logger in loggers:
            logger.setLevel(logging.NOTSET)
            for handler in [h for h in logger.handlers if getattr(h, "gate_verdicts", False)]:
                logger.removeHandler(handler)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_sampling_reports_exactness_as_not_applicable(one_thread):
    result = run_bench("toy", "tree,vanilla", batch_sizes=[2], repeats=1, warmup=0,
                       settings=BenchSettings(num_samples=2, max_new_tokens=6, temperature=1.0,
                                              options={"dim": "16", "num_layers": "2", "num_heads": "2"}))
    assert [c.label for c in result.configs] == ["vanilla", "tree"]  # the reference is always listed first
    assert {r.config.label: r.quality["exactness"] for r in result.runs} == \
        {"vanilla": "n/a (sampling)", "tree": "n/a (sampling)"}
    assert all(r.stats.num_target_forwards > 0 for r in result.runs)
    assert all(r.quality["calibration_tokens"] == 12 for r in result.runs)  # the distribution-level figures instead


def test_lossless_toy_methods_pass_the_token_calibration_test_and_a_bent_sampler_fails(one_thread):
    """At temperature 1 every lossless method's tokens are exact draws from the target (PIT uniform); tokens
    sampled at temperature 0.5 but scored at 1 (the control) are not."""
    from mmspec.bench.toy import build_toy, toy_calibration, toy_inputs

    settings = BenchSettings(num_samples=24, max_new_tokens=32, temperature=1.0,
                             options={"dim": "16", "num_layers": "2", "num_heads": "2"})
    result = run_bench("toy", "vanilla,draft-model,tree", batch_sizes=[8], repeats=1, warmup=0, settings=settings)
    for r in result.runs:
        assert r.quality["calibration_tokens"] == 24 * 32 and r.quality["pit_ks_pvalue"] > 0.001, r.config.label
    cold = BenchSettings(num_samples=24, max_new_tokens=32, temperature=0.5, options=settings.options)
    samples = toy_inputs(cold)
    outputs = [o for batch in (samples[i:i + 8] for i in range(0, 24, 8))
               for o in get_family("toy").methods["vanilla"].run(build_toy(cold), batch, cold, {}).outputs]
    figures = toy_calibration(build_toy(settings), samples, outputs, settings)
    assert figures["pit_ks_pvalue"] < 1e-6 and figures["pit_mean_shift"] < 0


# ----------------------------------------------------------------------------------------- fake family
class FakeFamily:
    """A registered family whose methods record every call (and whose build is counted)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.builds = 0
        self.fail: tuple[str, int] | None = None  # (method, batch size) that raises RuntimeError
        self.draw = False  # outputs drawn from the global torch generator instead of the sample ids
        self.stats: dict[str, Callable[[], SpecStats]] = {}  # method -> its batches' stats (default: forwards only)

    def method(self, name: str) -> Method:
        def run(models, batch, settings, params):
            self.calls.append((name, tuple(s.question_id for s in batch)))
            if self.fail == (name, len(batch)):
                raise RuntimeError("index 9 is out of bounds | boom")
            stats = self.stats[name]() if name in self.stats else SpecStats(num_target_forwards=settings.max_new_tokens)
            tokens = [torch.randint(0, 1000, (settings.max_new_tokens,)) if self.draw  # [n] each
                      else torch.full((settings.max_new_tokens,), s.question_id) for s in batch]
            return MethodOutput(outputs=tokens, new_tokens=[settings.max_new_tokens] * len(batch), stats=stats)

        return Method(run, params={"x": 1} if name == "b" else {})

    def build(self, settings):
        self.builds += 1
        return None

    def family(self) -> Family:
        return Family(name="fake", model_id="fake-model", build=self.build,
                      inputs=lambda s: [Sample(i, "fake", i) for i in range(s.num_samples)],
                      methods={n: self.method(n) for n in ("vanilla", "a", "b")},
                      quality=lambda method, params, outputs, reference, settings: {"same": float(
                          all(torch.equal(x, y) for x, y in zip(outputs, reference)))})


@pytest.fixture
def fake():
    family = FakeFamily()
    register_family("fake", family.family)
    yield family
    unregister_family("fake")


@pytest.mark.parametrize("interleave", ["batch", "pass"])
def test_runs_are_interleaved_warmup_first_per_batch_size(fake, interleave):
    result = run_bench("fake", "b,vanilla,a", batch_sizes=[2, 1], repeats=2, warmup=1,
                       settings=BenchSettings(num_samples=3, max_new_tokens=2), interleave=interleave)
    order = ["vanilla", "b", "a"]  # vanilla moves to the front; the others keep their order
    expected, rounds = [], 0
    for batches in ([(0, 1), (2,)], [(0,), (1,), (2,)]):  # batch size 2, then 1
        for _ in range(1 + 2):  # one warm-up pass, then two recorded passes
            # the configurations take turns going first: rotated by one every pass, and every batch in a pass
            expected += [(order[j], batches[i]) for i, j in round_order(3, len(batches), rounds, interleave)]
            rounds += 1
    assert fake.calls == expected
    assert {fake.calls[k][0] for k in range(0, 18, 6)} == set(order)  # batch size 2: each pass starts with another
    assert fake.builds == 1
    assert [(r.batch_size, r.repeat, r.config.label) for r in result.runs] == \
        [(b, r, m) for b in (2, 1) for r in (0, 1) for m in order]
    assert len(result.records) == 2 * 2 * 3 * 3
    assert all(r.quality == {"same": 1.0} for r in result.runs)
    steps = plan_steps([2, 1], result.configs, 1, 2)
    assert [s.warmup for s in steps[:3]] == [True] * 3 and not steps[3].warmup


def test_a_pass_order_rotates_the_first_and_varies_what_runs_before_each():
    """`round_order`: every configuration once per batch ("batch": batch i of all before batch i + 1; "pass": each
    configuration's batches in turn); the first rotates by one every pass and batch; in "batch" passes each
    configuration runs right after every other one somewhere (a cyclic order gives each one predecessor only), and
    the same arguments give the same order."""
    n, batches, pooled = 5, 12, set()
    for rotate in range(3):
        pairs = round_order(n, batches, rotate, "batch")
        assert pairs == round_order(n, batches, rotate, "batch")
        rounds = [[j for i, j in pairs if i == b] for b in range(batches)]
        assert [i for i, _ in pairs] == [b for b in range(batches) for _ in range(n)]
        assert all(sorted(r) == list(range(n)) for r in rounds)
        assert [r[0] for r in rounds] == [(rotate + b) % n for b in range(batches)]
        before = {(r[k - 1], r[k]) for r in rounds for k in range(1, n)}  # (predecessor, configuration)
        assert all(len({a for a, b in before if b == j}) >= 2 for j in range(n))  # cyclic: 1 each
        pooled |= before
        whole = round_order(n, 2, rotate, "pass")
        assert whole == [(i, (j + rotate) % n) for j in range(n) for i in range(2)]
    assert len(pooled) == n * (n - 1)  # over three passes every configuration ran after every other one


def test_batch_interleaved_passes_draw_what_whole_passes_draw(fake):
    """Each configuration's global random stream starts from the seed and carries on from its own previous batch,
    so interleaving batches changes the order of the runs, not what a method draws."""
    fake.draw = True  # outputs drawn from the global torch generator
    outputs = {}
    for interleave in ("batch", "pass"):
        result = run_bench("fake", "a,b", batch_sizes=[1], repeats=2, warmup=1, interleave=interleave,
                           settings=BenchSettings(num_samples=3, max_new_tokens=4))
        outputs[interleave] = [(r["method"], r["repeat"], r["question_id"], r["choices"][0]["turns"])
                               for r in sorted(result.records, key=lambda r: (r["method"], r["repeat"],
                                                                               r["question_id"]))]
    assert outputs["batch"] == outputs["pass"]
    draws = [turns for method, _, _, turns in outputs["batch"] if method == "a"]
    assert len({str(t) for t in draws}) == len(draws) // 2  # fresh draws per sample, repeated per pass


def test_a_failing_configuration_is_reported_and_the_others_go_on(fake, tmp_path, capsys):
    fake.fail = ("a", 2)  # "a" raises on full batches of 2, so only at batch size 2
    out = tmp_path / "failing"
    argv = ["bench", "--family", "fake", "--methods", "a,b", "--batch-sizes", "2,1", "--num-samples", "4",
            "--max-new-tokens", "2", "--repeats", "2", "--warmup", "1", "--no-plots", "--out", str(out)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "FAILED at batch size 2, a: RuntimeError: index 9 is out of bounds" in captured.err
    assert "| a | FAILED: RuntimeError: index 9 is out of bounds / boom |" in captured.out
    assert sum(1 for name, _ in fake.calls if name == "a") == 1 + 3 * 4  # failed once at bs 2; 3 passes at bs 1
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["batch_size"], r["method"]) for r in records} == {(2, "vanilla"), (2, "b"), (1, "vanilla"),
                                                                 (1, "a"), (1, "b")}
    summary = json.loads((out / "summary.json").read_text())
    assert rows_by_method(summary, 2)["a"]["failed"].startswith("RuntimeError")
    assert rows_by_method(summary, 1)["a"]["speedup"]["median"] > 0
    assert summary["failures"] == ["batch size 2, a: RuntimeError: index 9 is out of bounds | boom"]


def mostly_plain_batch() -> SpecStats:
    """A batch whose draft budget chose 1 chain of 2 (both accepted) and 3 plain steps, one row."""
    from mmspec.verify import VerifyResult

    stats = SpecStats(num_target_forwards=5)
    for drafted in (2, 0, 0, 0):
        accepted = torch.tensor([drafted])
        stats.record(VerifyResult(torch.zeros(1, drafted + 1, dtype=torch.long), accepted,
                                  torch.ones(1, drafted, dtype=torch.bool), accepted))
        stats.add_extra(f"budget_{drafted}", 1)
    stats.add_extra("calls_without_drafter", 0)
    return stats


def test_a_method_the_budget_kept_from_drafting_gets_one_line(fake, tmp_path, capsys):
    """One stderr line (and a line in summary.md) per method and batch size whose draft budget chose plain steps on
    most of its steps; none for the others."""
    fake.stats["a"] = mostly_plain_batch
    out = tmp_path / "plain"
    argv = ["bench", "--family", "fake", "--methods", "a,b", "--batch-sizes", "1", "--num-samples", "2",
            "--max-new-tokens", "2", "--repeats", "1", "--warmup", "0", "--no-plots", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: a (batch size 1, 1 pass) drafted on 2 of 8 verify steps")
    assert "6 plain steps" in notes[0] and "budget=fixed" in notes[0]
    rows = rows_by_method(json.loads((out / "summary.json").read_text()), 1)
    assert rows["a"]["budget_notice"] == notes[0] and rows["b"]["budget_notice"] is None
    assert rows["a"]["mean_acceptance_length"] == 3.0 and rows["a"]["acceptance_histogram"] == [0, 0, 2]
    assert f"- {notes[0]}" in (out / "summary.md").read_text()


def test_method_parameters_are_parsed_and_checked(fake):
    family = get_family("fake")
    configs = parse_method_list("a,b:x=3", family)
    assert [(c.label, dict(c.params)) for c in configs] == [("vanilla", {}), ("a", {}), ("b:x=3", {"x": 3})]
    with pytest.raises(InputError, match=r"method 'b' has no parameter 'y'; its parameters: x"):
        parse_method_list("b:y=1", family)
    with pytest.raises(InputError, match="listed twice"):
        parse_method_list("a,a", family)
    # a family option that sets a method parameter for every method (MAR's num_sampling_steps) shows in the params
    # of the methods that have it, unless a configuration sets it itself
    optioned = dataclasses.replace(family, option_params=lambda s: {"x": int(s.options["x"])})
    settings = BenchSettings(options={"x": "7"})
    configs = parse_method_list("a,b,b:x=3", optioned, settings)
    assert [dict(c.params) for c in configs] == [{}, {}, {"x": 7}, {"x": 3}]
    assert [dict(c.given) for c in configs] == [{}, {}, {}, {"x": 3}]  # what the runs receive is unchanged


def test_unknown_family_and_method_are_clear_errors(fake, tmp_path, capsys):
    with pytest.raises(InputError, match=r"unknown family 'nope'; known families: .*fake.*toy"):
        get_family("nope")
    with pytest.raises(InputError, match=r"unknown method 'c' for bench family 'fake'; known methods: vanilla, a, b"):
        parse_method_list("a,c", get_family("fake"))
    assert main(["bench", "--family", "nope", "--out", str(tmp_path / "o1")]) == 2
    assert "unknown family 'nope'" in capsys.readouterr().err
    assert main(["bench", "--family", "toy", "--methods", "tree,eagle9", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'eagle9'" in err and "draft-model, self-draft, tree, pld, sam, random" in err
    assert fake.builds == 0


def test_unwritable_output_dir_fails_before_any_work(fake, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for out in (blocker, blocker / "sub"):
        assert main(["bench", "--family", "fake", "--out", str(out)]) == 2
        assert "--out" in capsys.readouterr().err
    assert fake.builds == 0 and fake.calls == []


def test_bad_numbers_are_input_errors(tmp_path, capsys):
    for extra in (["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--repeats", "0"], ["--warmup", "-1"],
                  ["--family-option", "nokey"]):
        assert main(["bench", *extra, "--out", str(tmp_path / "o")]) == 2
        assert "mmspec: error:" in capsys.readouterr().err
    with pytest.raises(InputError, match="unknown option 'depth' for bench family 'toy'"):
        run_bench("toy", settings=BenchSettings(options={"depth": "3"}))
    with pytest.raises(InputError, match="device must be cpu or cuda, got 'gpu'"):
        run_bench("toy", settings=BenchSettings(device="gpu"))


def test_results_are_written_to_an_existing_directory(tmp_path, capsys):
    """--out may already exist (results are replaced, other files kept); --quiet hides the progress and the tables,
    not the line saying what was written."""
    out = Path(tmp_path)
    (out / "keep.txt").write_text("x")
    assert main(["bench", "--family", "toy", "--methods", "vanilla", "--num-samples", "1", "--max-new-tokens",
                 "2", "--repeats", "1", "--warmup", "0", "--no-plots", "--quiet", *SMALL_TOY,
                 "--out", str(out)]) == 0
    assert (out / "keep.txt").read_text() == "x" and (out / "results.jsonl").exists()
    printed = capsys.readouterr().out
    assert printed.startswith("wrote ") and "| method |" not in printed


def test_a_bench_reads_only_its_own_family_record(tmp_path, monkeypatch):
    """Listing the families with a bench hook imports every family's record (seconds of imports): only the error
    that prints the list may do it."""
    import mmspec.families as families

    read, get_record = [], families.get_family
    monkeypatch.setattr(families, "get_family", lambda name: read.append(name) or get_record(name))
    assert main(["bench", "--family", "toy", "--methods", "vanilla", "--num-samples", "1", "--max-new-tokens", "2",
                 "--repeats", "1", "--warmup", "0", "--no-plots", "--quiet", *SMALL_TOY, "--out", str(tmp_path)]) == 0
    assert set(read) == {"toy"}


def test_live_tensor_bytes_counts_what_a_window_allocates():
    from mmspec.bench.memory import PeakMemory

    weights = torch.zeros(10_000)  # made before the window: not counted
    with PeakMemory("cpu", tensors=True) as meter:
        meter.reset()
        a = torch.ones(1000, dtype=torch.float32)  # 4000 bytes
        b = a.view(10, 100)  # a view: same storage, not counted again
        del a, b
        c = torch.empty(500, dtype=torch.float64) + weights[:500]  # empty (4000) freed after the add (4000)
        peak = meter.peak()
        assert meter.kind == "tensor_peak"
    assert peak == 8000 and c.numel() == 500


def test_live_tensor_bytes_ignores_storages_of_earlier_windows():
    """A tensor made in one window and freed in the next must not lower the next window's count."""
    from mmspec.bench.memory import PeakMemory

    with PeakMemory("cpu", tensors=True) as meter:
        meter.reset()
        kept = torch.ones(1000)  # 4000 bytes, outlives its window
        meter.peak()
        meter.reset()
        del kept
        fresh = torch.ones(1000)  # 4000 bytes in the second window
        assert meter.peak() == 4000 and fresh.numel() == 1000
