"""The discrete image pipelines' default path (`budget="auto"`) under every decision its budget can take, forced so no
outcome depends on the machine's speed (`mmspec.testing.budgets.forced_budget`): for every family (LlamaGen c2i and
t2i, Janus, Emu3) and every lossless drafting method, greedy images over three calls that (1) draft and then settle
on plain steps for the rest of the call, (2) draft the full size, plain steps, a middle size and the smallest in
turn, and (3) run without the drafter are vanilla's greedy tokens (vanilla itself is proven against the official
code and transformers' `generate` in the families' own tests)."""

from __future__ import annotations

import copy

import pytest
import torch
from llamagen_dummies import get_dummy_components, get_dummy_t2i_components

from image_ar.llamagen.eagle import LlamaGenEagleDrafter
from image_ar.llamagen.pipeline import LlamaGenPipeline
from image_ar.transformers_ar.eagle import ImageAREagleDrafter
from image_ar.transformers_ar.tiny import tiny_emu3_pipeline, tiny_janus_pipeline
from mmspec.testing.budgets import CallScript, forced_budget

SCRIPTS = (CallScript(steps=("full", "small"), settle_after=2),  # drafting, then plain for the rest of the call
           CallScript(steps=("full", "plain", "chain", "small", "plain")),  # every kind of step in turn
           CallScript(drafts=False))  # a call without the drafter


def llamagen():
    components = get_dummy_components()
    components["eagle_drafter"] = LlamaGenEagleDrafter.for_target(components["transformer"]).eval()
    return LlamaGenPipeline(**components), {"class_labels": [0, 3, 1], "guidance_scale": 4.0}


def llamagen_t2i():
    components = get_dummy_t2i_components()
    draft = components["draft_transformer"] = copy.deepcopy(components["transformer"])  # a draft model that agrees
    with torch.no_grad():  # with the target in part (the dummy's own small draft agrees on nothing): drafts accepted
        noise = torch.randn(draft.output.weight.shape, generator=torch.Generator().manual_seed(2))
        draft.output.weight.add_(0.3 * noise)
    return LlamaGenPipeline(**components), {"prompt": ["a red circle", "the small green square on a blue background",
                                                       "a cross"], "guidance_scale": 4.0}


def transformers_ar(make):
    def build():
        pipe = make()
        torch.manual_seed(1)
        pipe.eagle_drafter = ImageAREagleDrafter.for_target(pipe.lm).eval()
        return pipe, {"prompt": ["a red circle", "two small blue squares on a green background", "a cross"]}
    return build


FAMILIES = {"llamagen": (llamagen, ("sjd", "draft-model", "eagle")),
            "llamagen-t2i": (llamagen_t2i, ("sjd", "draft-model", "eagle")),
            "janus": (transformers_ar(tiny_janus_pipeline), ("sjd", "eagle")),
            "emu3": (transformers_ar(tiny_emu3_pipeline), ("sjd", "eagle"))}
CASES = [(family, method) for family, (_, methods) in FAMILIES.items() for method in methods]


@pytest.mark.parametrize("family,method", CASES)
def test_forced_budget_decisions_keep_greedy_vanilla_tokens(family, method, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    pipe, inputs = FAMILIES[family][0]()
    pipe.set_progress_bar_config(disable=True)
    inputs = {**inputs, "temperature": 0.0, "output_type": "latent"}
    vanilla = pipe(**inputs)
    with forced_budget(*SCRIPTS) as budgets:
        for script in SCRIPTS:
            out = pipe(**inputs, method=method)
            assert torch.equal(out.tokens, vanilla.tokens), script
            drafted = out.stats.num_drafts > 0
            assert drafted == script.drafts, (script, out.stats.extra)
    settled, varied, without = budgets
    assert len(settled.choices) == 3 and settled.choices[2] == 0  # settled at its third step
    assert 0 in varied.choices and len(set(varied.choices)) >= 3
    assert without.choices == [] and out.stats.extra.get("calls_without_drafter") == 1


LAW_SCRIPT = CallScript(steps=("full", "plain", "chain", "small", "plain", "full"))  # sizes change every step


@pytest.mark.parametrize("method", ["sjd", "draft-model", "eagle"])
def test_forced_budget_decisions_keep_llamagen_sampled_law(method, tmp_path, monkeypatch):
    """800 images of one class at temperature 1 on the default path, the drafted size changing every step: the codes
    at positions 1-3, grouped by the codes before them, fit the target's own CFG law (pooled chi-square; teacher
    forced, `image_ar.llamagen.scoring`); the same counts against the law at temperature 0.8 must fail."""
    from image_ar.llamagen.scoring import target_probs
    from mmspec.testing.distributions import assert_fits_law_not_control, prefix_pairs

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    pipe, _ = llamagen()
    pipe.set_progress_bar_config(disable=True)
    tree = {"top_k": 4, "depth": 3, "total_tokens": 10} if method == "eagle" else {}  # (a short menu to time)
    with forced_budget(LAW_SCRIPT) as budgets:
        out = pipe(class_labels=[1] * 800, guidance_scale=4.0, method=method, method_kwargs=tree,
                   output_type="latent", generator=torch.Generator().manual_seed(0))
    assert out.stats.num_accepted_tokens > 0 and len(set(budgets[0].choices)) >= 3
    pairs = prefix_pairs(out.tokens.tolist(), range(1, 4))

    def law(temperature: float):
        def next_probs(prefix: tuple[int, ...]):
            tokens = torch.tensor([[*prefix, 0]])
            return target_probs(pipe, [1], tokens, 4.0, temperature)[0, len(prefix)].double().numpy()
        return next_probs

    assert_fits_law_not_control(pairs, law, 0.8, min_dof=10)


def row_generators(seeds) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


@pytest.mark.parametrize("family,method", CASES)
def test_sampled_default_path_gives_vanilla_images_for_the_same_seeds(family, method, tmp_path, monkeypatch):
    """At temperature 1 the default acceptance rule ("coupled") keeps the target's own sample at every token: under
    every forced budget decision each image is vanilla's for its seed, token for token, and a row generated alone
    is its row of the batch (whatever is drafted, whatever the budget picks, whatever the batch)."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    pipe, inputs = FAMILIES[family][0]()
    pipe.set_progress_bar_config(disable=True)
    inputs = {**inputs, "temperature": 1.0, "top_k": 0, "output_type": "latent"}
    seeds = (11, 12, 13)
    vanilla = pipe(**inputs, generator=row_generators(seeds))
    assert len({tuple(row) for row in vanilla.tokens.tolist()}) > 1  # sampled: the rows differ
    with forced_budget(*SCRIPTS):
        for script in SCRIPTS:
            out = pipe(**inputs, method=method, generator=row_generators(seeds))
            assert torch.equal(out.tokens, vanilla.tokens), script
    assert out.stats.extra.get("calls_without_drafter") == 1
    accepted = pipe(**inputs, method=method, generator=row_generators(seeds), budget="fixed").stats
    greedy = pipe(**{**inputs, "temperature": 0.0}, method=method, budget="fixed").stats
    # drafts were accepted, not only the target's own tokens kept (the dummy t2i's untrained EAGLE drafter agrees
    # with its target on no token, greedy included)
    assert accepted.num_accepted_tokens > 0 or greedy.num_accepted_tokens == 0
    condition = "class_labels" if "class_labels" in inputs else "prompt"
    alone = pipe(**{**inputs, condition: inputs[condition][1:2]}, method=method, generator=row_generators(seeds[1:2]))
    assert torch.equal(alone.tokens[0], vanilla.tokens[1])
