"""One record per family and method (`mmspec.families`): discovery through the entry points, parameters read from
the constructors a method forwards to, losslessness read from the rule, clear errors; and a method declared once
in a test shows up in `mmspec generate --help`, the bench and the image demo's method list, and runs."""

from pathlib import Path

import pytest
import torch

from mmspec.bench import BenchSettings, parse_method_list
from mmspec.bench import get_family as bench_family
from mmspec.cli import main
from mmspec.cli.registry import all_commands, command_help
from mmspec.errors import InputError
from mmspec.families import (
    CallMethod,
    DrafterMethod,
    FamilyRecord,
    LoopMethod,
    LoopParts,
    PipelineCall,
    available_families,
    get_family,
    parameters_of,
    register_family,
    split,
    unregister_family,
)
from mmspec.lm import NoDrafter
from mmspec.verify import GSDRule, LanternRule, LosslessRule, get_rule, rule_keeps_distribution


def test_the_installed_families_and_their_commands_are_found():
    assert {"llamagen", "mar", "toy", "var", "vlm"} <= set(available_families())
    assert set(available_families("generate")) == {"emu3", "janus", "llamagen", "llamagen-t2i", "lumina-mgpt", "mar",
                                                    "var"}
    t2i = get_family("llamagen-t2i")  # the t2i family shares the class-conditional one's method records
    assert t2i.condition == "prompt" and t2i.methods is get_family("llamagen").methods
    assert {"llamagen", "mar", "toy", "var", "vlm"} <= set(available_families("bench"))
    commands = all_commands()
    assert commands["train.mar-draft"] == "continuous.mar.distill" and commands["vlm"] == "vlm.cli"
    assert commands["generate"] == "mmspec.cli.generate"  # the core's own
    assert command_help("continuous.mar.convert_pipeline").startswith("official MAR files -> a pipeline folder")
    with pytest.raises(InputError, match="unknown family 'nope'; known families: .*llamagen"):
        get_family("nope")


def test_parameters_are_read_from_signatures():
    def build(ctx, window: int = 16, init: str = "random", *, extra=None, **kwargs):
        return None

    assert parameters_of(build) == {"window": 16, "init": "random", "extra": None}
    assert parameters_of(LanternRule, skip=("neighbours", "greedy")) == {"k": 1000, "delta": 0.1, "lam": None,
                                                                          "reject": "moved"}
    assert parameters_of(build, {"accept": "lossless"}, only=("window", "accept")) == {"window": 16,
                                                                                        "accept": "lossless"}
    tree, rule, rest = split({"window": 4, "delta": 0.2, "other": 1}, build, LanternRule)
    assert (tree, rule, rest) == ({"window": 4}, {"delta": 0.2}, {"other": 1})


def test_rules_say_when_they_keep_the_distribution():
    assert LosslessRule.keeps_distribution() and rule_keeps_distribution("lossless", {"delta": 0.3})
    assert not rule_keeps_distribution("lantern", {"delta": 0.1}) and rule_keeps_distribution("lantern", {"delta": 0})
    assert rule_keeps_distribution("lantern", {"lam": 1.0, "delta": 0.1})
    assert GSDRule(group_size=1).lossless and not GSDRule().lossless
    table = torch.arange(12).view(4, 3).to(torch.uint16)
    assert LanternRule(table, delta=0.0).lossless and not LanternRule(table, delta=0.2).lossless


def test_rules_check_their_own_inputs():
    from mmspec.verify import ChainDraft, accept

    p = torch.softmax(torch.randn(1, 2, 5), -1)
    table = torch.zeros(7, 3, dtype=torch.uint16)
    with pytest.raises(InputError, match="neighbour table covers 7 tokens but the target's vocabulary has 5"):
        accept(get_rule("lantern", neighbours=table), ChainDraft(torch.tensor([[1]])), p)
    with pytest.raises(InputError, match="GSD embeddings have 3 rows but the vocabulary has 5"):
        accept(GSDRule(embeddings=torch.zeros(3, 2)), ChainDraft(torch.tensor([[1]])), p)
    logits = torch.randn(1, 2, 5) * 10  # greedy verification takes logits
    assert accept("greedy", ChainDraft(torch.tensor([[1]])), logits).num_accepted.shape == (1,)
    with pytest.raises(InputError, match="target_probs"):
        accept("lossless", ChainDraft(torch.tensor([[1]])), logits)


def test_method_records_check_parameters_and_declarations():
    record = FamilyRecord("scratch")

    @record.method(params=(LanternRule,), skip=("neighbours", "greedy"), lossless=lambda p: p["delta"] == 0)
    def relaxed_copy(ctx, window: int = 2, **given):
        """A scratch method.

        More text that is not the description."""
        return ctx, (window, given)

    method = record.get_method("relaxed-copy")
    assert method.description == "A scratch method."
    assert method.params == {"k": 1000, "delta": 0.1, "lam": None, "reject": "moved", "window": 2}
    assert not method.is_lossless() and method.is_lossless({"delta": 0})
    built = method.build("ctx", {"delta": 0.3})  # only the given ones are passed
    assert isinstance(method, LoopMethod) and built == LoopParts("ctx", (2, {"delta": 0.3}))
    with pytest.raises(InputError, match="scratch method 'relaxed-copy' takes k, delta, lam, reject, window; got wide"):
        method.build("ctx", {"wide": 1}, "scratch")
    with pytest.raises(InputError, match="method_kwargs must be a dict of the method's parameters, got str"):
        method.build("ctx", "window=3")
    with pytest.raises(InputError, match="unknown scratch method 'nope'; available: relaxed-copy"):
        record.get_method("nope")
    with pytest.raises(InputError, match="declares method 'relaxed-copy' twice"):
        record.add("relaxed-copy", relaxed_copy, {})
    record.add("bad-shape", lambda ctx: (ctx, 1, 2), {})
    with pytest.raises(InputError, match="must build \\(drafter, rule\\), got tuple"):
        record.get_method("bad-shape").build("ctx")


def test_method_records_are_typed_by_what_they_build_and_say_what_they_need(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "image_ar"))
    from llamagen_dummies import get_dummy_components

    from image_ar.llamagen.pipeline import LlamaGenPipeline

    kinds = {name: {type(m) for m in get_family(name).methods.values()} for name in available_families()}
    assert kinds["llamagen"] == kinds["janus"] == kinds["emu3"] == kinds["lumina-mgpt"] == kinds["toy"] == {LoopMethod}
    assert kinds["var"] == kinds["mar"] == {CallMethod} and kinds["vlm"] == {DrafterMethod}
    assert get_family("vlm").methods["vanilla"].drafter_model is None
    assert get_family("var").get_method("code").needs == ("refiner",)
    assert get_family("mar").get_method("cspd").needs == ("draft",)
    llamagen = get_family("llamagen")
    assert [n for n, m in llamagen.methods.items() if m.needs] == ["draft-model", "eagle", "lantern"]
    components = get_dummy_components()
    def offered(pipe):
        return [name for name, method in llamagen.methods.items() if method.offered_by(pipe)]

    assert offered(LlamaGenPipeline(**components)) == ["vanilla", "draft-model", "sjd", "gsd"]
    assert offered(LlamaGenPipeline(components["transformer"], components["vqvae"])) == ["vanilla", "sjd", "gsd"]
    assert get_family("var").get_method("vanilla").build("pipe") == PipelineCall("pipe", {})
    with pytest.raises(InputError, match="builds nothing"):
        get_family("vlm").get_method("vanilla").build("pipe")


def test_registered_families_join_the_installed_ones():
    register_family(FamilyRecord("scratch-family", "a test family"))
    try:
        assert "scratch-family" in available_families() and get_family("scratch-family").description
        with pytest.raises(InputError, match="already registered"):
            register_family(FamilyRecord("scratch-family"))
        with pytest.raises(InputError, match="already registered"):
            register_family(FamilyRecord("llamagen"))
    finally:
        unregister_family("scratch-family")
    assert "scratch-family" not in available_families()


def test_a_method_declared_once_shows_up_in_generate_the_bench_and_the_demo(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "image_ar"))
    from llamagen_dummies import get_dummy_components

    from demos.image_app import speculative_methods
    from image_ar.llamagen.family import FAMILY
    from image_ar.llamagen.pipeline import LlamaGenPipeline

    @FAMILY.method()
    def vanilla_again(ctx, note: str = "hello"):
        """Vanilla decoding under another name (a test's toy method)."""
        return NoDrafter(), ctx.rule_name()

    try:
        with pytest.raises(SystemExit):
            main(["generate", "--help"])
        text = capsys.readouterr().out
        assert "vanilla-again (lossless): Vanilla decoding under another name" in text and "note='hello'" in text
        family = bench_family("llamagen")
        assert family.methods["vanilla-again"].params == {"note": "hello", "budget": None}  # + the bench's budget
        labels = [c.label for c in parse_method_list("vanilla-again:note=x", family)]
        assert labels == ["vanilla", "vanilla-again:note=x"]
        assert "vanilla-again" in speculative_methods("llamagen")
        pipe = LlamaGenPipeline(**get_dummy_components())
        pipe.set_progress_bar_config(disable=True)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        again = pipe(class_labels=[0, 1], method="vanilla-again", method_kwargs={"note": "x"}, generator=gens,
                     output_type="latent").tokens
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        assert torch.equal(again, pipe(class_labels=[0, 1], generator=gens, output_type="latent").tokens)
    finally:
        FAMILY.methods.pop("vanilla-again")
    assert "vanilla-again" not in bench_family("llamagen").methods


def test_the_mar_bench_records_the_diffusion_steps_it_runs():
    """`--family-option num_sampling_steps=N` runs every MAR method at N steps: their records say N (a method that
    sets its own keeps it), not the parameter's default of 100."""
    configs = parse_method_list("vanilla,cspd,cspd:num_sampling_steps=20", bench_family("mar"),
                                BenchSettings(options={"num_sampling_steps": "50"}))
    assert [c.params["num_sampling_steps"] for c in configs] == [50, 50, 20]
    assert [c.params["num_sampling_steps"] for c in parse_method_list("cspd", bench_family("mar"), BenchSettings())] \
        == [100, 100]
