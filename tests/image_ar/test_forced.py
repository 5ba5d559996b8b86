"""Acceptance-controlled runs (`mmspec.forced`): profiles, the draft rewrite, the loop under a profile (exact output,
acceptance at the asked rates) and the bench's `--force-acceptance` with its ideal speed-up."""

import json

import pytest
import torch
from llamagen_dummies import get_dummy_components

from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.bench import run_bench
from mmspec.bench.registry import BenchSettings
from mmspec.cli import main
from mmspec.errors import InputError
from mmspec.forced import (
    AcceptanceProfile,
    ForcedCall,
    Forcing,
    constant_rate_for,
    deepest_path,
    on_path,
    other_token,
    parse_forcing,
    parse_profile,
)
from mmspec.tree import DraftTree
from mmspec.verify import ChainDraft

SMALL_TOY = ["--threads", "1", "--family-option", "dim=16", "--family-option", "num_layers=2",
             "--family-option", "num_heads=2", "--family-option", "vocab_size=32"]


# ------------------------------------------------------------------------------------------------ profiles
def test_profile_forms_give_their_rates():
    assert parse_profile("alpha=0.7").rates == (0.7,)
    assert parse_profile("rates=0.9,0.5").rate_table(4, torch.device("cpu")).tolist() == pytest.approx(
        [0.9, 0.5, 0.5, 0.5])
    tau = parse_profile("tau=3.2:depth=5")
    assert tau.mean_accepted_length(5) == pytest.approx(3.2, abs=1e-6)
    assert constant_rate_for(1.0, 4) == pytest.approx(0.0, abs=1e-9)
    assert constant_rate_for(5.0, 4) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("text, says", [
    ("tau=3", "depth"), ("tau=9:depth=2", "[1, 3]"), ("rates=a", "forms"), ("alpha=2", "[0, 1]"), ("beta=1", "forms"),
    ("missing.json:method=eagle", "cannot read"), ("missing.json:what", "method=LABEL or batch=B"),
])
def test_bad_profiles_are_one_line_errors(text, says):
    with pytest.raises(InputError, match=None) as err:
        parse_forcing(text)
    assert says in str(err.value) and "\n" not in str(err.value)


def summary_file(tmp_path, rows):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"batch_sizes": [{"batch_size": 1, "methods": rows}]}))
    return path


def test_a_bench_summary_gives_each_method_its_own_row(tmp_path):
    path = summary_file(tmp_path, [
        {"method": "vanilla", "base_method": "vanilla", "per_position_acceptance_rate": []},
        {"method": "tree:depth=3", "base_method": "tree", "per_position_acceptance_rate": [0.8, 0.4, 0.1]},
        {"method": "draft-model", "base_method": "draft-model", "per_position_acceptance_rate": [0.5]}])
    forcing = parse_forcing(str(path))
    assert forcing.profile_for("tree:depth=3", "tree").rates == pytest.approx((0.8, 0.5, 0.25))  # r_i / r_(i-1)
    assert forcing.profile_for("tree", "tree").rates == pytest.approx((0.8, 0.5, 0.25))  # by method
    assert forcing.profile_for("draft-model:k=2", "draft-model").rates == (0.5,)
    assert forcing.profile_for("self-draft", "self-draft") is None
    assert forcing.unprofiled([("vanilla", "vanilla"), ("tree", "tree"), ("self-draft", "self-draft")]) == [
        "self-draft"]
    with pytest.raises(InputError, match="no row for any method run"):
        forcing.unprofiled([("vanilla", "vanilla"), ("self-draft", "self-draft")])
    one = parse_forcing(f"{path}:method=tree:depth=3")
    assert one.profile_for("anything", "draft-model").rates == pytest.approx((0.8, 0.5, 0.25))


# ------------------------------------------------------------------------------------------------ rewriting
def test_other_token_differs_and_stays_in_the_vocabulary():
    reference = torch.tensor([0, 1, 5, 63])
    other = other_token(reference)
    assert bool((other != reference).all()) and int(other.min()) >= 0 and int(other.max()) <= 63


def small_tree() -> DraftTree:
    # root 0 -> children 1, 2; 1 -> 3, 4; 2 -> 5; 4 -> 6; node 7 padding
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 4, -1]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 3, 0]])
    valid = torch.tensor([[True] * 7 + [False]])
    tokens = torch.where(valid, torch.arange(8) + 10, -1)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, valid=valid, max_depth=3, max_children=2)


def test_the_forced_path_leads_to_the_deepest_node():
    tree = small_tree()
    path = deepest_path(tree)
    assert path.tolist() == [[0, 1, 4, 6]]
    assert on_path(tree, path).tolist() == [[True, True, False, False, True, False, True, False]]


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_rewrite_copies_the_reference_on_the_path_at_its_rate(alpha):
    reference = torch.arange(100, 120).unsqueeze(0)  # [1, 20]
    call = ForcedCall(AcceptanceProfile((alpha,)), reference)
    generated = torch.tensor([4])
    chain = call.rewrite(ChainDraft(torch.tensor([[7, 7, -1]]), num_draft=torch.tensor([2])), generated, None)
    expected = reference[0, 4:6] if alpha else other_token(reference[0, 4:6])
    assert chain.tokens[0, :2].tolist() == expected.tolist() and chain.tokens[0, 2] == -1  # padding kept
    tree = call.rewrite(small_tree(), generated, None)
    on_path = [1, 4, 6]  # depths 1, 2, 3 -> token indices 4, 5, 6
    for node in range(1, 7):
        want = int(reference[0, 4 + int(tree.depths[0, node]) - 1])
        assert (int(tree.tokens[0, node]) == want) == (alpha == 1.0 and node in on_path)
    assert int(tree.tokens[0, 0]) == 10 and int(tree.tokens[0, 7]) == -1  # the root and the padding stay
    assert call.rewrites == 2


# ------------------------------------------------------------------------------------------------ the loop
@pytest.fixture(scope="module")
def pipe():
    from image_ar.llamagen.eagle import LlamaGenEagleDrafter

    components = get_dummy_components()
    components["eagle_drafter"] = LlamaGenEagleDrafter.for_target(components["transformer"]).eval()
    pipe = LlamaGenPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def forced_calls(pipe, forcing, method, temperature, **kwargs):
    labels = [0, 1, 2, 3] * 4
    generators = lambda: [torch.Generator().manual_seed(i) for i in range(len(labels))]  # noqa: E731
    with forcing.call(range(len(labels)), record=True):
        reference = pipe(class_labels=labels, generator=generators(), temperature=temperature, output_type="latent")
    with forcing.call(range(len(labels)), method, method) as call:
        out = pipe(class_labels=labels, generator=generators(), temperature=temperature, method=method,
                   output_type="latent", budget="fixed", **kwargs)
    return reference.tokens, out, call


@pytest.mark.parametrize("method", ["sjd", "eagle", "draft-model"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_calls_keep_vanillas_tokens_and_accept_at_the_rates(pipe, method, temperature):
    for alpha in (1.0, 0.0):
        reference, out, call = forced_calls(pipe, Forcing(profile=AcceptanceProfile((alpha,))), method,
                                            temperature)
        assert torch.equal(out.tokens, reference) and call.rewrites > 0
        assert out.stats.draft_acceptance_rate == alpha  # accepted / drafted


@pytest.mark.parametrize("method, kwargs", [("gsd", {}), ("lantern", {}), ("sjd", {"accept": "lossless"}),
                                            ("eagle", {"accept": "gsd"})])
def test_rules_that_are_not_exact_get_the_profiles_decision(pipe, method, kwargs):
    for alpha in (1.0, 0.0):
        reference, out, call = forced_calls(pipe, Forcing(profile=AcceptanceProfile((alpha,))), method, 1.0,
                                            method_kwargs=kwargs)
        assert torch.equal(out.tokens, reference) and call.decisions == call.rewrites > 0
        assert out.stats.draft_acceptance_rate == alpha


def test_exact_rules_decide_themselves(pipe):
    _, _, call = forced_calls(pipe, Forcing(profile=AcceptanceProfile((0.5,))), "eagle", 1.0)
    assert call.rewrites > 0 and call.decisions == 0


def test_forced_acceptance_follows_a_half_rate(pipe):
    reference, out, _ = forced_calls(pipe, Forcing(profile=AcceptanceProfile((0.5,))), "sjd", 1.0,
                                     method_kwargs={"window": 4})
    rates = out.stats.per_position_acceptance_rate
    assert torch.equal(out.tokens, reference)
    assert 0.35 < rates[0] < 0.65 and 0.1 < rates[1] < 0.45, rates  # 0.5, 0.25 (about 100 drafts)


def test_outside_a_forced_call_drafts_are_the_drafters_own(pipe):
    forcing = Forcing(profile=AcceptanceProfile((1.0,)))
    forced_calls(pipe, forcing, "sjd", 1.0)
    out = pipe(class_labels=[0, 1], generator=[torch.Generator().manual_seed(i) for i in range(2)], method="sjd",
               output_type="latent", budget="fixed")
    assert out.stats.per_position_acceptance_rate[0] < 1.0  # a random tiny model's own drafts


# ------------------------------------------------------------------------------------------------ the bench
def test_bench_force_acceptance_reports_forced_drafts_and_ideal_speedups(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["bench", "--family", "toy", "--methods", "vanilla,draft-model,tree", "--batch-sizes", "2",
            "--warmup", "0", "--repeats", "1", "--num-samples", "2", "--max-new-tokens", "12", "--temperature", "0",
            "--device", "cpu", "--quiet", "--no-plots", "--force-acceptance", "alpha=1", *SMALL_TOY,
            "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["force_acceptance"] == "alpha=1"
    rows = {r["method"]: r for r in summary["batch_sizes"][0]["methods"]}
    for name in ("draft-model", "tree"):
        row = rows[name]
        assert row["forced_drafts"] > 0 and row["draft_acceptance_rate"] == 1.0
        assert row["quality"]["exactness"] == 1.0
        assert row["ideal_speedup"] > 0 and row["system_efficiency"] == pytest.approx(
            row["speedup"]["median"] / row["ideal_speedup"])
    assert "acceptance forced by the profile `alpha=1`" in (out / "summary.md").read_text()
    assert "ideal speed-up" in (out / "summary.md").read_text()


def test_bench_force_acceptance_refuses_a_family_outside_the_loop():
    from mmspec.bench import Family, Method, MethodOutput, Sample, register_family, unregister_family
    from mmspec.stats import SpecStats

    def run(models, batch, settings, params):
        return MethodOutput(outputs=[0] * len(batch), new_tokens=[1] * len(batch), stats=SpecStats())

    register_family("outside", lambda: Family(
        name="outside", model_id="m", build=lambda s: None, inputs=lambda s: [Sample(0, "c", 0)],
        methods={"vanilla": Method(run), "a": Method(run)}, quality=lambda *a: {}))
    try:
        with pytest.raises(InputError, match="decode through the shared loop"):
            run_bench("outside", "vanilla,a", repeats=1, warmup=0, settings=BenchSettings(num_samples=1),
                      forcing=Forcing(profile=AcceptanceProfile((1.0,))))
    finally:
        unregister_family("outside")
