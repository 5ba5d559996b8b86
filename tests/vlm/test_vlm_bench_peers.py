"""The transformers peers of the vlm bench (`vlm.bench_peers`) on a tiny world LLaVA: greedy outputs equal
mmspec's vanilla answers, forwards are counted, and transformers' own failure (prompt lookup copying <image> ids)
is reported per row instead of stopping the bench; mmspec's own training-free methods beside them keep a table per
configuration."""

from __future__ import annotations

from mmspec.bench.registry import BenchSettings, Sample
from vlm.bench_peers import peer_methods
from vlm.tiny import tiny_vlm
from vlm.world import world_vqa_examples


def test_peers_give_vanilla_answers_and_report_transformers_errors():
    vlm = tiny_vlm("llava")
    settings = BenchSettings(num_samples=3, max_new_tokens=8, temperature=0.0)
    examples = world_vqa_examples("test", 3, seed=0, long_fraction=1.0)
    batch = [Sample(question_id=i, category=ex.qa.kind, data=ex) for i, ex in enumerate(examples)]
    vanilla = vlm.generate([ex.image for ex in examples], [ex.prompt for ex in examples], 8).token_ids
    models = {"target": vlm, "top_p": 1.0}
    methods = peer_methods()
    for name, given in (("hf_generate", {}), ("hf_assisted", {}), ("hf_prompt_lookup", {})):
        out = methods[name].run(models, batch, settings, given)
        assert [o["tokens"] for o in out.outputs] == vanilla, name
        assert not any(o["transformers_error"] for o in out.outputs) and out.stats.num_target_forwards > 0, name
    assisted = methods["hf_assisted"].run(models, batch, settings, {"layers": 1})
    assert assisted.stats.num_draft_forwards > 0
    raw = methods["hf_prompt_lookup"].run(models, batch, settings, {"suppress_image_token": 0})
    failed = [o for o in raw.outputs if o["transformers_error"]]  # transformers 5.23: <image> ids as candidates
    assert all(o["tokens"] == [] and o["error"] for o in failed)


def test_training_free_configurations_differing_in_budget_keep_their_own_tables():
    """`recycle` on budget auto and fixed in one bench run: two pipes, two tables (a table learns from its calls)."""
    from mmspec.bench.registry import get_family

    settings = BenchSettings(num_samples=2, max_new_tokens=6, temperature=0.0)
    examples = world_vqa_examples("test", 2, seed=0, long_fraction=1.0)
    batch = [Sample(question_id=i, category=ex.qa.kind, data=ex) for i, ex in enumerate(examples)]
    models = {"target": tiny_vlm("llava"), "drafters": {}, "folder": "tiny", "top_p": 1.0}
    recycle = get_family("vlm").methods["recycle"]
    outputs = [recycle.run(models, batch, settings, given).outputs for given in ({}, {"budget": "fixed"}, {})]
    assert [o["tokens"] for o in outputs[0]] == [o["tokens"] for o in outputs[1]] == [o["tokens"] for o in outputs[2]]
    tables = {id(pipe.drafter.table) for pipe in models["pipes"].values()}
    assert len(models["pipes"]) == 2 and len(tables) == 2
