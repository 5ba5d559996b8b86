"""A feature drafter's pending pairs run every pair's K/V and the root's pair alone past them
(`FeatureTreeDrafter.run_pending`, `mmspec.draft_layers.run_layer_column`): the same drafts as the whole pass, so
the same answers and accept lengths, for every drafter kind, chains and trees."""

import pytest

import mmspec.draft_layers as draft_layers
from mmspec.data.artifacts import ASSETS_DIR
from vlm.family import DRAFTER_KINDS
from vlm.pipeline import SpeculativeVLM
from vlm.world import world_vqa_examples


@pytest.fixture(scope="module")
def questions():
    examples = world_vqa_examples("test", 6, seed=5, long_fraction=1.0)
    return [ex.image for ex in examples], [ex.prompt for ex in examples]


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_the_root_pair_alone_drafts_as_the_whole_pass(kind, questions, monkeypatch):
    vlm = SpeculativeVLM.from_pretrained(ASSETS_DIR / "vlm", kind)
    columns = []
    original = draft_layers.run_layer_column

    def counted(layer, plan, x, *args):
        columns.append(x.shape[1])
        return original(layer, plan, x, *args)

    monkeypatch.setattr(draft_layers, "run_layer_column", counted)
    for tree in [(6, 1, 7), (4, 4, 12)]:
        runs = []
        for one_column in (True, False):
            vlm.drafter.runs_one_column = one_column
            out = vlm.generate(*questions, max_new_tokens=40, batch_size=6, temperature=0.0, tree=tree,
                               budget="fixed")
            runs.append((out.token_ids, out.stats.accept_lengths_per_row()))
            assert bool(columns) == one_column and (not columns or max(columns) > 1), (tree, columns)
            columns.clear()
        assert runs[0] == runs[1], tree
        assert max(max(row) for row in runs[0][1]) > 2  # (drafts were accepted: the drafts compared)
