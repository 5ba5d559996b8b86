"""LlamaGen methods `sjd` and `gsd` (declared in image_ar/llamagen/family.py) on the tiny dummy pipeline.

(Greedy SJD with CFG equals the full-forward greedy reference token for token: the method contract,
tests/test_contract.py.) Sampled SJD / GSD / SJD with
LANTERN acceptance are reproducible with seeds and per-image independent of the batch; GSD with groups of one is
token-identical to lossless SJD; SJD never needs more target forwards than vanilla; bad parameters are clear
errors. The example in docs/sjd_gsd.md runs on the embedded model (assets/llamagen).
"""

import re
from pathlib import Path

import pytest
import torch
from llamagen_dummies import get_dummy_components

from image_ar.llamagen.family import FAMILY
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.errors import InputError
from mmspec.jacobi import JacobiDrafter
from mmspec.testing.clock import modelled_clock
from mmspec.verify import GSDRule, LanternRule

ROOT = Path(__file__).resolve().parents[2]
LABELS = [0, 2, 3]


@pytest.fixture(scope="module")
def pipe():
    p = LlamaGenPipeline(**get_dummy_components())
    p.set_progress_bar_config(disable=True)
    return p


def sampled(pipe, method, seed=0, labels=LABELS, **kwargs):
    """A seeded sampled call with the method's configured size every step (budget="fixed": seeded calls repeat and
    an image does not depend on its batch)."""
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(labels))]
    return pipe(class_labels=labels, guidance_scale=3.0, top_k=16, generator=gens, method=method,
                method_kwargs=kwargs, output_type="latent", budget="fixed")


def test_methods_are_registered():
    assert {"sjd", "gsd"} <= set(FAMILY.methods)


def test_greedy_sjd_with_lantern_acceptance_drafts_and_saves_forwards(pipe):
    """(Greedy SJD's exact settings against the full-forward reference: tests/test_contract.py.)"""
    out = pipe(class_labels=LABELS, guidance_scale=2.5, temperature=0, method="sjd",
               method_kwargs={"accept": "lantern", "k": 8}, output_type="latent", budget="fixed")
    assert out.stats.num_draft_tokens > 0 and out.stats.num_target_forwards <= 16


def test_greedy_jacobi_converges_in_fewer_forwards_on_a_predictable_model():
    """A model whose greedy continuation is (almost) constant lets Jacobi accept whole windows."""
    comps = get_dummy_components()
    with torch.no_grad():
        comps["transformer"].output.weight.zero_()
        comps["transformer"].output.weight[5] = 1.0  # logits favour token 5 wherever the features are positive
    p = LlamaGenPipeline(**comps)
    p.set_progress_bar_config(disable=True)
    van = p(class_labels=LABELS, guidance_scale=1.0, temperature=0, output_type="latent")
    sjd = p(class_labels=LABELS, guidance_scale=1.0, temperature=0, method="sjd",
            method_kwargs={"init": "repeat_horizon"}, output_type="latent", budget="fixed")
    assert torch.equal(sjd.tokens, van.tokens)
    assert sjd.stats.num_target_forwards < van.stats.num_target_forwards / 2


CODE_GSD = {"embeddings": "codebook", "group_size": 14, "group_window": "code"}


@pytest.mark.parametrize("method, kwargs, rule", [("sjd", {}, str), ("gsd", {}, GSDRule), ("gsd", CODE_GSD, GSDRule),
                                                  ("sjd", {"accept": "lantern", "k": 8, "delta": 0.2}, LanternRule),
                                                  ("sjd", {"accept": "gsd", "group_size": 5}, GSDRule)])
def test_sampled_methods_are_reproducible_and_valid(pipe, method, kwargs, rule):
    a, b = sampled(pipe, method, 3, **kwargs), sampled(pipe, method, 3, **kwargs)
    assert torch.equal(a.tokens, b.tokens)
    assert a.tokens.shape == (3, 16) and (a.tokens >= 0).all() and (a.tokens < 64).all()
    assert a.stats.num_target_forwards <= 16
    from image_ar.llamagen.methods import MethodContext
    from mmspec.sampling import SamplingParams

    ctx = MethodContext(pipe, SamplingParams(), 3.0, None, 3)
    drafter, built = FAMILY.get_method(method).build(ctx, kwargs)
    assert isinstance(drafter, JacobiDrafter) and isinstance(built, rule)


def test_gsd_measures_distances_on_the_target_embeddings_by_default(pipe):
    """As the official GSD code (Lumina-mGPT's embed_tokens); the VQ codebook is the named option."""
    from image_ar.llamagen.methods import MethodContext
    from mmspec.sampling import SamplingParams

    ctx = MethodContext(pipe, SamplingParams(), 3.0, None, 1)
    _, default = FAMILY.get_method("gsd").build(ctx)
    assert torch.equal(default.embeddings, pipe.transformer.tok_embeddings.weight.float())
    assert default.group_window == "shifted"
    _, codebook = FAMILY.get_method("gsd").build(ctx, {"embeddings": "codebook", "group_window": "code"})
    assert torch.equal(codebook.embeddings, pipe.vqvae.codebook().float()) and codebook.group_window == "code"
    _, eagle_gsd = FAMILY.get_method("sjd").build(ctx, {"accept": "gsd"})
    assert torch.equal(eagle_gsd.embeddings, default.embeddings)


def test_gsd_with_groups_of_one_is_token_identical_to_lossless_sjd(pipe):
    for seed in (0, 7):
        gsd = sampled(pipe, "gsd", seed, group_size=1, window=6)
        sjd = sampled(pipe, "sjd", seed, window=6, accept="lossless")
        assert torch.equal(gsd.tokens, sjd.tokens)
        assert gsd.stats.num_target_forwards == sjd.stats.num_target_forwards


@pytest.mark.parametrize("method", ["sjd", "gsd"])
def test_an_image_does_not_depend_on_its_batch(pipe, method):
    batch = sampled(pipe, method, 4, labels=[0, 1, 2])
    single = pipe(class_labels=[1], guidance_scale=3.0, top_k=16, generator=[torch.Generator().manual_seed(5)],
                  method=method, output_type="latent", budget="fixed")
    assert torch.equal(batch.tokens[1], single.tokens[0])


def test_a_window_longer_than_the_default_cache_room_runs_exact():
    """The target keeps cache room for the drafter's window (`max_draft_nodes`), not a fixed 64 entries: a window of
    100 on a 100-token image, sampled late in the image too, gives vanilla's tokens under the coupled rule."""
    p = LlamaGenPipeline(**get_dummy_components(block_size=100))
    p.set_progress_bar_config(disable=True)

    def call(**kwargs):
        gens = [torch.Generator().manual_seed(i) for i in range(len(LABELS))]
        return p(class_labels=LABELS, generator=gens, top_k=16, output_type="latent", **kwargs)

    sjd = call(method="sjd", method_kwargs={"window": 100}, budget="fixed")
    assert torch.equal(sjd.tokens, call().tokens) and sjd.tokens.shape[1] == 100
    assert sjd.stats.num_target_forwards < 100
    with pytest.raises(InputError, match=r"window must be <= 100 \(the image's 100 tokens"):
        p(class_labels=[0], method="sjd", method_kwargs={"window": 101}, output_type="latent")


def test_sjd_needs_no_more_target_forwards_than_vanilla(pipe):
    vanilla = sampled(pipe, "vanilla", 1)
    for kwargs in ({}, {"init": "repeat_horizon"}, {"window": 3}, {"interval": "reference", "window": 4}):
        out = sampled(pipe, "sjd", 1, **kwargs)
        assert out.stats.num_target_forwards <= vanilla.stats.num_target_forwards == 16


@pytest.mark.parametrize("method, kwargs, match", [
    ("sjd", {"window": 0}, "window"), ("sjd", {"window": 100}, "window"), ("gsd", {"window": "16"}, "window"),
    ("sjd", {"init": "zeros"}, "init"), ("gsd", {"init": None}, "init"),
    ("sjd", {"interval": (5, 3)}, "interval"), ("sjd", {"interval": (0, 99)}, "interval"),
    ("sjd", {"interval": (16, None)}, "interval"), ("sjd", {"interval": "all"}, "interval"),
    ("gsd", {"interval": (-2, 5)}, "interval"), ("sjd", {"interval": "reference"}, "interval"),
    ("sjd", {"accept": "exact"}, "acceptance mode"), ("gsd", {"embeddings": "clip"}, "embeddings"),
    ("gsd", {"group_size": 0}, "group_size"), ("sjd", {"accept": "lossless", "delta": 0.1}, "parameters"),
])
def test_bad_parameters_are_clear_errors(pipe, method, kwargs, match):
    with pytest.raises(InputError, match=match):
        pipe(class_labels=[0], method=method, method_kwargs=kwargs, output_type="latent")


def test_the_documented_example_runs_on_the_embedded_model():
    assert (ROOT / "assets" / "llamagen" / "README.md").is_file(), "assets/llamagen (the embedded model) is missing"
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "sjd_gsd.md").read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/sjd_gsd.md", "exec"), {"__name__": "__doc_example__"})


def test_parameters_of_another_acceptance_mode_are_named(pipe):
    takes = "group_size, p_thr, d_thr, embeddings, group_window"
    with pytest.raises(InputError, match=f"accept='gsd' takes {takes}; got delta"):
        pipe(class_labels=[0], method="sjd", method_kwargs={"accept": "gsd", "delta": 0.1}, output_type="latent")


@pytest.mark.parametrize("method", ["sjd", "draft-model"])
def test_the_auto_budget_keeps_greedy_tokens_and_learns_across_calls(pipe, method, tmp_path, monkeypatch):
    """The budget's decisions on a modelled clock (`mmspec.testing.clock`): the same on any machine and load."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))  # the measured step costs of this dummy pipeline
    blocks = [*pipe.transformer.layers, *(pipe.draft_transformer.layers if method == "draft-model" else [])]
    with modelled_clock({block: (1e-4, 2e-6) for block in blocks}):
        learns_across_calls(pipe, method)


def learns_across_calls(pipe, method):
    pipe.budgets.clear()
    greedy = dict(class_labels=LABELS, guidance_scale=1.0, temperature=0, output_type="latent")
    vanilla = pipe(**greedy).tokens
    auto = pipe(**greedy, method=method)  # budget="auto" is the default of a lossless method
    assert torch.equal(auto.tokens, vanilla)
    assert sum(v for k, v in auto.stats.extra.items() if k.startswith("budget_")) == auto.stats.num_target_forwards - 1
    budget = next(iter(pipe.budgets.values()))  # kept between calls of the same method, batch size and setting
    steps = sum(budget.chosen.values())
    estimated, drafted = budget._estimated  # the first call's choices by estimate, and those that drafted
    assert budget.gate.calls == {"drafted": 1, "without_drafter": 0}
    assert torch.equal(pipe(**greedy, method=method).tokens, vanilla) and len(pipe.budgets) == 1
    if drafted or not estimated:  # drafting paid (or nothing was decided yet): the same budget drafted again
        assert budget.gate.calls == {"drafted": 2, "without_drafter": 0} and sum(budget.chosen.values()) > steps
    else:  # no choice by estimate drafted: the next calls run without the drafter (the call gate)
        assert budget.gate.calls == {"drafted": 1, "without_drafter": 1} and sum(budget.chosen.values()) == steps

    def auto_sampled(budget="auto"):
        gens = [torch.Generator().manual_seed(3 + i) for i in range(len(LABELS))]
        return pipe(class_labels=LABELS, guidance_scale=3.0, top_k=16, generator=gens, method=method,
                    budget=budget, output_type="latent").tokens

    tokens = auto_sampled()
    assert tokens.shape == vanilla.shape and bool(((tokens >= 0) & (tokens < pipe.transformer.config.vocab_size)).all())
    with pytest.raises(InputError, match="budget must be one of"):
        auto_sampled("fast")
