"""`mmspec.compile` on the tiny LlamaGen: a compiled step forward computes what the eager one does (logits, cache
writes, the features EAGLE reads), every method gives the eager tokens when its models are compiled (greedy and
seeded sampling, CFG, batch 3), it can be undone, and bad modes or families are clear errors. CPU inductor."""

import pytest
import torch
from llamagen_dummies import get_dummy_components
from torch._dynamo.utils import counters

import mmspec.compile
from image_ar.llamagen.eagle import LlamaGenEagleDrafter
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.cli import main
from mmspec.compile import CachePool, compile_cached_lm, compile_pipeline, uncompile_cached_lm
from mmspec.errors import InputError

METHODS = ["vanilla", "sjd", "eagle", "draft-model"]


def dummy_pipeline() -> LlamaGenPipeline:
    comps = get_dummy_components()
    torch.manual_seed(1)
    pipe = LlamaGenPipeline(**comps, eagle_drafter=LlamaGenEagleDrafter.for_target(comps["transformer"]).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def step_inputs(model, rows: int, new: int):
    cache = model.new_cache(rows, 40)
    cache.lengths += 3  # a committed prefix
    slots = cache.slots(new)  # [R, S]
    tokens = torch.randint(0, 64, (rows, new), generator=torch.Generator().manual_seed(new))
    return tokens, slots, cache, cache.attention_mask(slots)


@pytest.mark.parametrize("which", ["transformer", "eagle_drafter"])
def test_compiled_step_forward_computes_the_eager_one(which):
    pipe = dummy_pipeline()
    model = getattr(pipe, which)
    extra = {}
    if which == "eagle_drafter":
        extra["features"] = torch.randn(4, 5, model.config.dim, generator=torch.Generator().manual_seed(2))
    tokens, slots, cache, mask = step_inputs(model, 4, 5)
    want = model.forward_cached(tokens, slots, cache, slots, mask, **extra)  # [R, S, V]
    want_hidden, want_k = model.last_hidden.clone(), cache.k[0].clone()
    compile_cached_lm(model)
    model.check_positions = False  # as the pipelines run it: the check reads the positions on the host
    tokens, slots, cache, mask = step_inputs(model, 4, 5)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    got = model.forward_cached(tokens, slots, cache, slots, mask, **extra)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # dynamo compiled it, whole
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.last_hidden, want_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k[0], want_k, atol=1e-6, rtol=1e-6)  # the K/V writes land in the cache
    assert model.compile_mode == "default"
    uncompile_cached_lm(model)
    assert model.compile_mode is None and model.forward_cached.__func__ is type(model).forward_cached


@pytest.fixture(scope="module")
def eager_and_compiled():
    eager, compiled = dummy_pipeline(), dummy_pipeline().compile_forwards("default")
    return eager, compiled


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_eager_tokens_with_compiled_forwards(eager_and_compiled, method):
    eager, compiled = eager_and_compiled
    assert compiled.transformer.compile_mode == compiled.eagle_drafter.compile_mode == "default"
    for temperature in (0.0, 1.0):
        runs = []
        for pipe in (eager, compiled):
            gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
            out = pipe(class_labels=[0, 2, 3], guidance_scale=2.5, temperature=temperature, top_k=16,
                       generator=gens, method=method, output_type="latent", budget="fixed")  # auto times steps
            runs.append(out)
        assert torch.equal(runs[0].tokens, runs[1].tokens), (method, temperature)
        assert runs[0].stats.num_target_forwards == runs[1].stats.num_target_forwards


def test_the_cuda_graph_path_reuses_caches_and_copies_outputs(monkeypatch):
    """The bookkeeping around CUDA graphs (pooled static caches, outputs copied before the next replay), run on
    the CPU by pretending the device records graphs; the graphs themselves need a GPU."""
    monkeypatch.setattr(mmspec.compile, "uses_cuda_graphs", lambda mode, device: True)
    eager, compiled = dummy_pipeline(), dummy_pipeline().compile_forwards("reduce-overhead")
    assert isinstance(compiled.transformer.new_cache, CachePool)
    tokens = []
    for method in ("vanilla", "eagle"):
        for pipe in (eager, compiled):
            gens = [torch.Generator().manual_seed(i) for i in range(2)]
            tokens.append(pipe(class_labels=[1, 2], top_k=16, generator=gens, method=method, budget="fixed",
                               output_type="latent").tokens)  # sampled: auto's timed choices differ between the two
        assert torch.equal(tokens[-2], tokens[-1]), method
    pool = compiled.transformer.new_cache
    first = pool(4, 30)
    first.lengths += 5
    assert pool(4, 30) is first and int(first.lengths.sum()) == 0  # the same buffers, reset
    assert pool(2, 30) is not first
    compiled.compile_forwards(None)
    assert not isinstance(compiled.transformer.new_cache, CachePool)


def test_bad_modes_and_uncompilable_pipelines_are_clear_errors():
    pipe = dummy_pipeline()
    with pytest.raises(InputError, match="unknown compile mode 'fast'.*reduce-overhead"):
        pipe.compile_forwards("fast")
    with pytest.raises(InputError, match="not a cached model"):
        compile_cached_lm(torch.nn.Linear(2, 2))
    with pytest.raises(InputError, match="the object has no compiled forwards"):
        compile_pipeline(object(), "default")
    assert compile_pipeline(pipe, None) is pipe
    assert getattr(pipe.transformer, "compile_mode", None) is None


def test_generate_cli_with_compile_writes_the_eager_images(tmp_path):
    folder = tmp_path / "pipe"
    dummy_pipeline().save_pretrained(folder)
    images = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "default"])):
        out = tmp_path / name
        assert main(["generate", "--model", str(folder), "--classes", "0,3", "--num-images", "2", "--out", str(out),
                     "--quiet", *extra]) == 0
        images[name] = {p.name: p.read_bytes() for p in sorted((out / "images").glob("*.png"))}
    assert len(images["eager"]) == 4 and images["compiled"] == images["eager"]


def test_bench_compile_option_is_checked_before_any_work(tmp_path, capsys):
    common = ["bench", "--methods", "vanilla", "--batch-sizes", "1", "--num-samples", "1", "--repeats", "1",
              "--warmup", "0", "--no-plots", "--quiet"]
    assert main([*common, "--family", "llamagen", "--family-option", "compile=fast", "--out", str(tmp_path / "a")]) == 2
    assert "unknown compile mode 'fast'" in capsys.readouterr().err
    assert main([*common, "--family", "var", "--family-option", "compile=default", "--out", str(tmp_path / "b")]) == 2
    assert "the CoDePipeline has no compiled forwards" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ compile="auto"
def write_verdict(model, mode: str, ratio: float) -> None:
    from mmspec.profiling import cached_json

    cached_json(mmspec.compile.verdict_key(model, "cpu", mode), lambda: {"mode": mode, "ratio": ratio}, refresh=True)


def test_auto_compiles_only_where_a_measured_verdict_says_it_pays(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))  # its own cache: other tests write verdicts for the same model
    pipe = dummy_pipeline()
    assert mmspec.compile.auto_compile_mode(pipe.transformer, "cpu") == (None, float("inf"))  # nothing measured
    pipe.compile_forwards("auto")
    assert all(getattr(m, "compile_mode", None) is None for m in (pipe.transformer, pipe.eagle_drafter))
    assert capsys.readouterr().err == ""  # eager without a word where nothing was measured
    write_verdict(pipe.transformer, "default", 1.3)  # compiled forwards were slower: eager
    write_verdict(pipe.transformer, "max-autotune", 0.97)  # faster, but not by the margin
    assert mmspec.compile.auto_compile_mode(pipe.transformer, "cpu") == (None, 0.97)
    assert getattr(compile_pipeline(pipe, "auto").transformer, "compile_mode", None) is None
    write_verdict(pipe.transformer, "reduce-overhead", 0.6)  # the best mode that pays
    assert mmspec.compile.auto_compile_mode(pipe.transformer, "cpu") == ("reduce-overhead", 0.6)
    compile_pipeline(pipe, "auto")
    assert pipe.transformer.compile_mode == "reduce-overhead"
    assert getattr(pipe.eagle_drafter, "compile_mode", None) is None
    assert "compiling the transformer's step forwards (reduce-overhead" in capsys.readouterr().err
    compile_pipeline(pipe, None)  # None leaves it as it is; compile_forwards(None) undoes it
    assert pipe.transformer.compile_mode == "reduce-overhead"
    assert pipe.compile_forwards(None).transformer.compile_mode is None
    assert compile_pipeline(object(), "auto") is not None  # auto on a pipeline without compiled forwards: as it is


def full_verdict(mode: str, eager_ms: float, compiled_ms: float, compile_seconds: float) -> dict:
    """A verdict as `measure_compile` makes it, at batch sizes 1 and 8 (8x the time) and widths 1 and 16."""
    return {"mode": mode, "batch_sizes": [1, 8], "widths": [1, 16], "compile_seconds": compile_seconds,
            "eager": [[eager_ms * 1e-3 * b * w for w in (1, 2)] for b in (1, 8)],
            "compiled": [[compiled_ms * 1e-3 * b * w for w in (1, 2)] for b in (1, 8)],
            "ratio": compiled_ms / eager_ms}


def test_compile_pays_for_a_job_that_saves_more_than_the_compilation_costs():
    verdict = full_verdict("default", eager_ms=10, compiled_ms=6, compile_seconds=8.0)  # 2 s a shape
    job = mmspec.compile.JobSize
    pays, saving, cost = mmspec.compile.compile_pays_for_job(verdict, job((1,), 256))
    assert not pays and saving == pytest.approx(256 * 4e-3) and cost == pytest.approx(2.0 * 4)
    pays, saving, cost = mmspec.compile.compile_pays_for_job(verdict, job((1,) * 10, 256))
    assert pays and saving == pytest.approx(10 * 256 * 4e-3) and cost == pytest.approx(8.0)
    # calls of 6 images read the batch-8 row (nearest in ratio); a last call of 2 images compiles its own shapes
    pays, saving, cost = mmspec.compile.compile_pays_for_job(verdict, job((6, 6, 2), 100))
    assert saving == pytest.approx(100 * (2 * 32e-3 + 4e-3)) and cost == pytest.approx(2 * 8.0)
    assert mmspec.compile.compile_pays_for_job({"ratio": 0.5}, job((1,), 1))[0]  # no times: the ratio decides
    slower = full_verdict("default", eager_ms=10, compiled_ms=12, compile_seconds=0.0)
    assert not mmspec.compile.compile_pays_for_job(slower, job((1,) * 100, 256))[0]


def test_auto_leaves_a_short_job_eager_and_compiles_a_long_one(capsys):
    from mmspec.profiling import cached_json

    pipe = dummy_pipeline()
    tokens = pipe.image_token_layout()[0]
    # the compiled one-token forward saves 10 ms at batch 1; compiling a shape costs 1 s (4 per call size)
    verdict = full_verdict("default", eager_ms=20, compiled_ms=10, compile_seconds=4.0)
    cached_json(mmspec.compile.verdict_key(pipe.transformer, "cpu", "default"), lambda: verdict, refresh=True)
    short = [1] * (int(4.0 / (tokens * 10e-3)) // 2)  # half the calls the compilation needs
    compile_pipeline(pipe, "auto", call_batch_sizes=short)
    assert getattr(pipe.transformer, "compile_mode", None) is None
    err = capsys.readouterr().err
    assert "leaving the transformer eager" in err and "compiling them costs ~4 s" in err and "--compile default" in err
    compile_pipeline(pipe, "auto", call_batch_sizes=short * 3)
    assert pipe.transformer.compile_mode == "default"
    assert "compiling the transformer's step forwards (default" in capsys.readouterr().err
    pipe.compile_forwards(None)


def test_measure_compile_times_both_and_leaves_the_model_eager():
    pipe = dummy_pipeline()
    model = pipe.transformer
    calls = []

    def make_run():
        compiled = getattr(model, "compile_mode", None)

        def run(batch: int, width: int) -> None:
            calls.append((compiled, batch, width))
            torch.ones(200 * width if compiled else 100 * width).sum()  # compiled: "slower"

        return run

    verdict = mmspec.compile.measure_compile(model, make_run, [1, 2], [1, 4], "default", repeats=3)
    assert verdict["mode"] == "default" and verdict["batch_sizes"] == [1, 2] and verdict["widths"] == [1, 4]
    assert len(verdict["eager"]) == 2 and len(verdict["compiled"][0]) == 2 and verdict["compile_seconds"] >= 0
    assert verdict["ratio"] > 0 and {c for c, _, _ in calls} == {None, "default"}  # both timed
    assert getattr(model, "compile_mode", None) is None  # left eager


def test_the_profile_times_the_eagle_drafter_as_its_trees_run_it():
    """The family's profile hook has a runner for the EAGLE drafter too (so `mmspec profile --compile` measures it
    and compile="auto" can compile it): W (token, feature) pairs after half an image's, CFG pairs, uncommitted."""
    from image_ar.llamagen.family import profile

    pipe = dummy_pipeline()
    runners = profile(pipe)
    assert set(runners) == {"transformer", "draft_transformer", "eagle_drafter"}
    model, run = runners["eagle_drafter"]
    assert model is pipe.eagle_drafter
    for batch, width in ((1, 1), (3, 5), (3, 5)):
        run(batch, width)
        assert model.last_hidden.shape == (2 * batch, width, model.dim)  # the CFG pair's rows


def test_profile_cli_caches_the_verdict_that_auto_reads(tmp_path, capsys, monkeypatch):
    from mmspec.cli import profile as profile_cli

    def fake_measure(model, make_run, batch_sizes, widths, mode, repeats, device, progress=None):
        return {"mode": mode, "batch_sizes": batch_sizes, "widths": widths, "eager": [[1e-3] * len(widths)] *
                len(batch_sizes), "compiled": [[5e-4] * len(widths)] * len(batch_sizes), "compile_seconds": 2.0,
                "ratio": 0.5}

    monkeypatch.setattr(mmspec.compile, "measure_compile", fake_measure)
    folder = tmp_path / "pipe"
    dummy_pipeline().save_pretrained(folder)
    assert main(["profile", "--family", "llamagen", "--model", str(folder), "--batch-sizes", "1", "--widths", "1,2",
                 "--repeats", "1", "--compile", "default"]) == 0
    out = capsys.readouterr().out
    assert "transformer: ms per forward compiled (default) (x eager); compilation 2.0 s" in out
    assert "geometric mean 0.50x: compile=auto compiles" in out and "| 1 | 0.50 (0.50x) | 0.50 (0.50x) |" in out
    assert profile_cli.format_verdict("m", {**fake_measure(None, None, [1], [1], "default", 1, "cpu"),
                                            "ratio": 1.2}).count("stays eager") == 1
    pipe = LlamaGenPipeline.from_pretrained(folder)
    assert mmspec.compile.auto_compile_mode(pipe.transformer, "cpu") == ("default", 0.5)
