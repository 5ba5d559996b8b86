"""EAGLE drafter for LlamaGen, methods `eagle` and `lantern`, and `mmspec train llamagen-drafter` on dummies."""

import argparse
import json

import pytest
import torch
from llamagen_dummies import get_dummy_components, reference_greedy_cfg
from safetensors.torch import load_file

from image_ar.llamagen import train_eagle
from image_ar.llamagen.eagle import EagleTreeDrafter, LlamaGenEagleDrafter
from image_ar.llamagen.pipeline import LlamaGenPipeline
from mmspec.errors import InputError
from mmspec.testing import use_sequential_lossless_walk
from mmspec.testing.budgets import CyclingBudget
from mmspec.tree import DraftTree

LABELS = [0, 2, 3]
SCALE = 2.5


def train_args(pipeline, work, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_eagle.add_arguments(parser)
    return parser.parse_args(["--pipeline", str(pipeline), "--work-dir", str(work), "--data", "target",
                              "--num-train-sequences", "256", "--batch-size", "16", "--threads", "1", "--quiet",
                              "--no-compile", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A dummy pipeline folder with an eagle_drafter trained for 120 steps on the target's own samples."""
    folder = tmp_path_factory.mktemp("pipe")
    LlamaGenPipeline(**get_dummy_components()).save_pretrained(folder)
    assert train_eagle.run(train_args(folder, folder / "work", "--steps", "120", "--eval-images", "0")) == 0
    pipe = LlamaGenPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def untrained():
    comps = get_dummy_components()
    torch.manual_seed(1)
    pipe = LlamaGenPipeline(**comps, eagle_drafter=LlamaGenEagleDrafter.for_target(comps["transformer"]).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample(pipe, method, seed=0, n=3, **kwargs):
    """A seeded sampled call drafting the configured tree every step (budget="fixed": seeded calls repeat)."""
    gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(n)]
    return pipe(class_labels=[i % 4 for i in range(n)], guidance_scale=3.0, top_k=16, generator=gens, method=method,
                output_type="latent", method_kwargs=kwargs or None, budget="fixed")


def test_greedy_eagle_with_a_trained_drafter_equals_greedy_vanilla_and_accepts(trained):
    """(An untrained drafter's trees, the last larger than the 64 drafts a target cache once kept room for: the
    method contract, tests/test_contract.py.)"""
    want = reference_greedy_cfg(trained.transformer, LABELS, SCALE)
    lengths = []
    for kwargs in ({}, {"top_k": 3, "depth": 5, "total_tokens": 12}, {"top_k": 9, "depth": 8, "total_tokens": 70}):
        out = trained(class_labels=LABELS, guidance_scale=SCALE, temperature=0, method="eagle", method_kwargs=kwargs,
                      output_type="latent", budget="fixed")
        assert torch.equal(out.tokens, want)
        lengths.append(out.stats.mean_acceptance_length)
    assert lengths[0] > 1.3, lengths  # the default tree (top_k 10, depth 4, 59 nodes); measured 1.67


def test_trees_are_valid_with_ragged_acceptance_and_cfg(untrained):
    trees, emitted = [], []
    propose = EagleTreeDrafter.propose

    def recording(self, state):
        tree = propose(self, state)
        trees.append(tree)
        return tree

    EagleTreeDrafter.propose = recording
    try:
        out = sample(untrained, "eagle", seed=1, n=8, top_k=4, depth=3, total_tokens=10)
    finally:
        EagleTreeDrafter.propose = propose
    for tree in trees:
        assert isinstance(tree, DraftTree) and tree.tokens.shape == (8, 10)
        tree.validate(vocab_size=64)
    for row in out.stats.accept_lengths_per_row():
        emitted.append(tuple(row))
    assert len(set(emitted)) > 1  # rows accepted different amounts
    assert (out.tokens >= 0).all()


def test_feature_bookkeeping_matches_a_teacher_forced_drafter(trained):
    """At every proposal, the drafter's output at the root pair equals an uncached drafter forward over the
    true (target feature, token) pairs of the final sequence: features pair with the right tokens and positions,
    for both CFG halves, with ragged rows."""
    captured = []
    run_pending = EagleTreeDrafter.run_pending

    def recording(self):
        logits, hidden, slot = run_pending(self)
        captured.append((slot.clone(), hidden.clone()))
        return logits, hidden, slot

    EagleTreeDrafter.run_pending = recording
    try:
        out = sample(trained, "eagle", seed=2, n=3)
    finally:
        EagleTreeDrafter.run_pending = run_pending
    target, drafter = trained.transformer, trained.eagle_drafter
    tokens = out.tokens  # [3, 16]
    labels = torch.tensor([0, 1, 2])
    with torch.no_grad():
        features = []
        for drop in (False, True):  # conditional rows, then unconditional rows (the CFG layout)
            target(tokens, labels, drop_mask=torch.full((3,), drop))
            features.append(target.last_hidden[:, target.config.cls_token_num - 1:])  # [3, 16, dim]
        reference = drafter(torch.cat(features), torch.cat([tokens, tokens]))  # [6, 16, dim]
    checked = 0
    for slot, hidden in captured:
        for r in range(6):
            n = int(slot[r % 3])  # the root is image token n
            if n < 16:
                torch.testing.assert_close(hidden[r], reference[r, n], atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked > 20


def test_tree_candidates_are_scored_like_a_chain_along_their_path(trained, monkeypatch):
    """A candidate's drafter output equals an uncached drafter forward over the true pairs of the prefix followed
    by the pairs (parent's drafter output, token) along its tree path: pool slots, tree attention, positions and
    parent features are right, for both CFG halves."""
    import mmspec.feature_drafter as eagle_module  # the shared EAGLE-2 tree drafting

    calls, expand = [], eagle_module.expand_eagle2

    def recording_expand(root_tokens, score, **kwargs):
        levels = []

        def recording_score(tokens, ids, parent_ids, depth):
            out = score(tokens, ids, parent_ids, depth)
            if depth > 0:
                levels.append((tokens.clone(), ids.clone(), parent_ids.clone(), drafter.last_hidden.clone()))
            return out

        calls.append(levels)
        return expand(root_tokens, recording_score, **kwargs)

    roots, run_pending = [], EagleTreeDrafter.run_pending

    def recording_pending(self):
        logits, hidden, slot = run_pending(self)
        roots.append((slot.clone(), hidden.clone()))
        return logits, hidden, slot

    drafter = trained.eagle_drafter
    monkeypatch.setattr(eagle_module, "expand_eagle2", recording_expand)
    monkeypatch.setattr(EagleTreeDrafter, "run_pending", recording_pending)
    out = sample(trained, "eagle", seed=3, n=2, top_k=3, depth=3, total_tokens=12)
    monkeypatch.undo()
    target, tokens = trained.transformer, out.tokens  # [2, 16]
    with torch.no_grad():
        features = []
        for drop in (False, True):
            target(tokens, torch.tensor([0, 1]), drop_mask=torch.full((2,), drop))
            features.append(target.last_hidden[:, target.config.cls_token_num - 1:])  # [2, 16, dim]
        features = torch.cat(features)  # [4, 16, dim]
        for (slot, root_hidden), levels in list(zip(roots, calls))[2:4]:
            for r in range(4):
                b = r % 2
                n = int(slot[b])
                hidden = {0: root_hidden[r]}  # pool id -> drafter output
                token, parent = {}, {}
                for toks, ids, parents, out_hidden in levels:
                    for j in range(ids.shape[1]):
                        i = int(ids[b, j])
                        hidden[i], token[i], parent[i] = out_hidden[r, j], int(toks[b, j]), int(parents[b, j])
                node = int(levels[-1][1][b, 0])  # a depth-2 candidate
                path = [node]
                while parent[path[0]] != 0:
                    path.insert(0, parent[path[0]])
                pair_features = torch.stack([features[r, i] for i in range(n + 1)]
                                            + [hidden[0]] + [hidden[i] for i in path[:-1]])
                pair_tokens = torch.cat([tokens[b, : n + 1], torch.tensor([token[i] for i in path])])
                reference = drafter(pair_features[None], pair_tokens[None])[0, -1]
                torch.testing.assert_close(hidden[node], reference, atol=1e-4, rtol=1e-4)


def test_lantern_with_delta_zero_equals_lossless_eagle(trained, monkeypatch):
    """delta = 0 moves no mass: LANTERN's walk is then the lossless rule's sequential walk (which `lossless` now
    replaces by its one-pass form of the same distribution, so the walk is put back here to compare tokens)."""
    use_sequential_lossless_walk(monkeypatch)
    for seed in range(3):
        a = sample(trained, "eagle", seed=seed, accept="lossless")
        b = sample(trained, "lantern", seed=seed, delta=0.0)
        assert torch.equal(a.tokens, b.tokens)


def test_lantern_is_reproducible_and_accepts_more(trained):
    a = sample(trained, "lantern", seed=5, delta=0.2)
    b = sample(trained, "lantern", seed=5, delta=0.2)
    assert torch.equal(a.tokens, b.tokens) and (a.tokens >= 0).all()
    eagle = [sample(trained, "eagle", seed=s, n=8).stats.mean_acceptance_length for s in range(3)]
    lantern = [sample(trained, "lantern", seed=s, n=8, delta=0.2).stats.mean_acceptance_length for s in range(3)]
    assert sum(lantern) >= sum(eagle)


def test_save_and_load_round_trip(trained, tmp_path):
    trained.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["eagle_drafter"] == ["image_ar.llamagen.eagle", "LlamaGenEagleDrafter"]
    keys = set(load_file(str(tmp_path / "eagle_drafter" / "diffusion_pytorch_model.safetensors")))
    assert keys and all(k.startswith(("fc.", "layers.")) for k in keys)  # the target's embeddings/head not stored
    loaded = LlamaGenPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.eagle_drafter, LlamaGenEagleDrafter)
    assert torch.equal(sample(trained, "eagle", seed=7).tokens, sample(loaded, "eagle", seed=7).tokens)


def test_methods_without_a_drafter_explain_how_to_train_one():
    comps = get_dummy_components()
    pipe = LlamaGenPipeline(**comps)
    pipe.set_progress_bar_config(disable=True)
    for method in ("eagle", "lantern"):
        with pytest.raises(InputError, match="eagle_drafter.*mmspec train llamagen-drafter"):
            pipe(class_labels=[0], method=method)


@pytest.mark.parametrize("kwargs, match", [
    ({"top_k": 2, "depth": 2, "total_tokens": 50}, "total_tokens"), ({"depth": 0}, "depth"),
    ({"bogus": 1}, "takes top_k, depth, total_tokens, child_ranking, accept"), ({"accept": "nope"}, "acceptance mode"),
])
def test_bad_method_parameters_are_clear_errors(untrained, kwargs, match):
    with pytest.raises(InputError, match=match):
        untrained(class_labels=[0], method="eagle", method_kwargs=kwargs)
    with pytest.raises(InputError, match="bad parameters|total_tokens|depth"):
        untrained(class_labels=[0], method="lantern", method_kwargs={k: v for k, v in kwargs.items() if k != "accept"}
                  or {"accept": "lossless"})


def test_a_drafter_for_another_target_is_refused(untrained):
    other = untrained.draft_transformer  # dim 16, the drafter was made for dim 32
    with pytest.raises(InputError, match="another target"):
        untrained.eagle_drafter.attach(other)


def test_training_command_smoke_and_resume(tmp_path, monkeypatch):
    folder = tmp_path / "pipe"
    LlamaGenPipeline(**get_dummy_components()).save_pretrained(folder)
    assert train_eagle.run(train_args(folder, tmp_path / "work", "--steps", "2", "--eval-images", "2")) == 0
    card = (folder / "eagle_drafter" / "README.md").read_text()
    assert "mmspec train llamagen-drafter" in card and "eagle, temperature 0" in card
    info = json.loads((folder / "eagle_drafter" / "training.json").read_text())
    assert info["train"]["steps"] == 2 and info["acceptance"]["n"] == 2
    assert json.loads((folder / "model_index.json").read_text())["eagle_drafter"][1] == "LlamaGenEagleDrafter"
    assert LlamaGenPipeline.from_pretrained(folder).eagle_drafter is not None

    # an interrupted run resumes from its checkpoint and ends where an uninterrupted one does
    pipe = LlamaGenPipeline.from_pretrained(folder)
    pipe.transformer.requires_grad_(False)
    data = {"ids": torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0)),
            "labels": torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(1))}
    args = train_args(folder, tmp_path / "w1", "--steps", "4", "--checkpoint-every", "2")
    (tmp_path / "w1").mkdir()
    whole, _ = train_eagle.train_drafter(pipe, data, args, tmp_path / "w1")

    teacher, calls = train_eagle.teacher_features, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return teacher(*a, **k)

    monkeypatch.setattr(train_eagle, "teacher_features", failing)
    (tmp_path / "w2").mkdir()
    args2 = train_args(folder, tmp_path / "w2", "--steps", "4", "--checkpoint-every", "2")
    with pytest.raises(KeyboardInterrupt):
        train_eagle.train_drafter(pipe, data, args2, tmp_path / "w2")
    monkeypatch.setattr(train_eagle, "teacher_features", teacher)
    resumed, info = train_eagle.train_drafter(pipe, data, args2, tmp_path / "w2")
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_training_command_rejects_bad_input(tmp_path):
    with pytest.raises(InputError, match="model_index"):
        train_eagle.run(train_args(tmp_path, tmp_path / "work", "--steps", "1"))
    folder = tmp_path / "pipe"
    LlamaGenPipeline(**get_dummy_components()).save_pretrained(folder)
    with pytest.raises(InputError, match="--data target"):  # 16x16 dummy images are not world images
        train_eagle.run(train_args(folder, tmp_path / "work", "--steps", "1", "--data", "world"))


def test_tree_shapes_changing_every_step_keep_greedy_tokens(trained, monkeypatch, tmp_path):
    from image_ar.llamagen import pipeline as pipeline_module
    from mmspec.tree import TreeShape

    want = reference_greedy_cfg(trained.transformer, LABELS, SCALE)
    shapes = [0, 0, 0, 0, 0, 0, TreeShape(1, 3, 4), TreeShape(10, 2, 8), 0, TreeShape(10, 4, 59), 0, 0]
    monkeypatch.setattr(pipeline_module, "make_budget", lambda *args: CyclingBudget(shapes))
    out = trained(class_labels=LABELS, guidance_scale=SCALE, temperature=0, method="eagle", output_type="latent")
    assert torch.equal(out.tokens, want)
    assert {"budget_0", "budget_chain3", "budget_tree10x2n8"} <= set(out.stats.extra)
    monkeypatch.undo()
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))  # the timed shapes of this dummy pipeline
    auto = trained(class_labels=LABELS, guidance_scale=SCALE, temperature=0, method="eagle", output_type="latent",
                   budget="auto")
    assert torch.equal(auto.tokens, want)
    assert sum(v for k, v in auto.stats.extra.items() if k.startswith("budget_")) == auto.stats.num_target_forwards - 1
    assert list(tmp_path.glob("profiles/*.json"))  # the shapes' times were cached
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    sampled = trained(class_labels=LABELS, guidance_scale=SCALE, top_k=16, generator=gens, method="lantern",
                      output_type="latent", budget="auto")
    assert (sampled.tokens >= 0).all() and trained.budgets  # the tree budgets stay with the pipeline
