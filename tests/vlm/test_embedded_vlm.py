"""The embedded VLM default (assets/vlm) as users meet it: the target answers held-out questions as its card says (on
a small sample), every shipped drafter is lossless on the real models (greedy speculative == the target alone,
token for token, on ragged batches of 4 held-out long answers) and drafts more than one token per round, and
`mmspec vlm --drafter auto` uses one."""

import json

import pytest
import torch

from mmspec.cli import main
from mmspec.data.artifacts import ASSETS_DIR
from mmspec.feature_drafter import FeatureTreeDrafter
from mmspec.tree import DraftTree
from vlm.family import DRAFTER_KINDS
from vlm.pipeline import SpeculativeVLM
from vlm.train import evaluate
from vlm.world import world_vqa_examples

FOLDER = ASSETS_DIR / "vlm"


@pytest.fixture(scope="module")
def examples():
    return world_vqa_examples("test", 8, seed=0, long_fraction=1.0)


@pytest.fixture(scope="module")
def target() -> SpeculativeVLM:
    return SpeculativeVLM.from_pretrained(FOLDER)


@pytest.fixture(scope="module")
def vanilla(examples, target):
    return target.generate([ex.image for ex in examples], [ex.prompt for ex in examples], max_new_tokens=64,
                        use_drafter=False)


def test_every_drafter_kind_ships():
    for kind in DRAFTER_KINDS:
        assert (FOLDER / "drafters" / kind / "config.json").is_file(), kind
        card = (FOLDER / "drafters" / kind / "README.md").read_text()
        assert "token-for-token equal to the target alone: True" in card, kind


def test_the_target_answers_short_questions(target):
    """The card reports the accuracy on 1902 questions; every question of 40 held-out scenes must clear 0.8 (a
    model that ignores the image scores about 0.35: the most common answer of each question kind)."""
    result = evaluate(target.model, target.processor, n_scenes=40, n_long=4, seed=0)
    assert result["short"]["accuracy"] >= 0.8, result["short"]
    assert result["long"]["contains_short"] >= 0.75, result["long"]


@pytest.mark.parametrize("budget", ["fixed", "auto"])
@pytest.mark.parametrize("kind", list(DRAFTER_KINDS))
def test_shipped_drafter_is_lossless_and_drafts(kind, budget, examples, vanilla, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))  # budget="auto" times its shapes here
    vlm = SpeculativeVLM.from_pretrained(FOLDER, kind)
    begins, heads_in_begin = [], []  # the loop drafter's begins; its head's calls inside one (their shapes)
    loop_drafter = vlm.drafter.loop_drafter  # the class the loop runs for this drafter
    begin, head = loop_drafter.begin, vlm.drafter.head

    def begin_counted(self, *args, **kwargs):
        begins.append(True)
        try:
            return begin(self, *args, **kwargs)
        finally:
            begins[-1] = False

    monkeypatch.setattr(loop_drafter, "begin", begin_counted)
    monkeypatch.setattr(vlm.drafter, "head", lambda h: (begins and begins[-1] and heads_in_begin.append(h.shape))
                        or head(h))
    out = vlm.generate([ex.image for ex in examples], [ex.prompt for ex in examples], max_new_tokens=64,
                       batch_size=4, budget=budget)  # two ragged batches of 4 (rows end at different steps)
    assert out.token_ids == vanilla.token_ids
    if budget == "auto":  # what auto drafts follows this machine's measured step times (a loaded machine may run
        # mostly plain steps); its warm-up step always drafts, so the first call drafts at least once
        chosen = {k: v for k, v in out.stats.extra.items() if k.startswith("budget_")}
        assert sum(chosen.values()) == out.stats.num_target_forwards - 2  # every step but the two prefills chose
        assert sum(v for k, v in chosen.items() if k != "budget_0") >= 1, chosen
        assert out.stats.num_draft_forwards > 0
        return
    assert out.stats.mean_acceptance_length >= 1.5, out.stats.mean_acceptance_length
    assert out.stats.num_target_forwards < vanilla.stats.num_target_forwards
    # the prompt pass fills the drafter's cache without its head (the [B, P, H] x [H, V] product EAGLE's code skips)
    assert len(begins) == 2 and not heads_in_begin, heads_in_begin


def test_mmspec_vlm_auto_uses_a_shipped_drafter(tmp_path, capsys):
    from PIL import Image

    from mmspec.data import generate_batch

    image = tmp_path / "scene.png"
    Image.fromarray(generate_batch(1, 0, split="test").images[0].permute(1, 2, 0).numpy()).save(image)
    assert main(["vlm", "--image", str(image), "--prompt", "What color is the object?"]) == 0
    captured = capsys.readouterr()
    assert "drafter: eagle" in captured.err  # auto: the first of eagle, vispec, msd, specvlm found
    figures = json.loads(captured.err.strip().splitlines()[-1])
    assert captured.out.strip() in ("red", "green", "blue", "yellow") and figures


def test_profile_times_the_target_and_every_shipped_drafter(tmp_path, monkeypatch, capsys):
    """`mmspec profile --family vlm`: the target after world prompts and each shipped drafter after its own prompt
    pass, per batch size and width, cached."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    assert main(["profile", "--family", "vlm", "--batch-sizes", "1,2", "--widths", "1,4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    names = ["target", *(f"{kind}_drafter" for kind in DRAFTER_KINDS)]
    assert [line.split(":")[0] for line in out.splitlines() if "ms per forward" in line] == names
    assert out.count("| 2 |") == len(names) and len(list((tmp_path / "profiles").glob("*.json"))) == len(names)
    assert main(["profile", "--family", "vlm", "--compile", "default"]) == 2  # nothing would read the verdict
    assert "has no compiled forwards" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_path_gives_the_tree_paths_tokens(temperature, examples, monkeypatch):
    """A chain shape (top_k 1) drafts without the candidate pool (`propose_chain`), verifies with the causal mask,
    accepts by the rule's chain form and commits in place; the same steps through the tree machinery (the pool,
    the tree mask, the tree rule, `commit_path`) give the same tokens, greedy and seeded sampling alike."""
    vlm = SpeculativeVLM.from_pretrained(FOLDER, "eagle")
    images, prompts = [ex.image for ex in examples[:4]], [ex.prompt for ex in examples[:4]]

    def run():
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        out = vlm.generate(images, prompts, max_new_tokens=48, batch_size=4, budget="fixed", tree=(5, 1, 6),
                           temperature=temperature, generator=gens)
        return out.token_ids, out.stats.num_target_forwards, out.stats.accept_lengths_per_row()

    fast = run()
    monkeypatch.setattr(FeatureTreeDrafter, "propose", FeatureTreeDrafter.propose_tree)
    monkeypatch.setattr(DraftTree, "is_chain", property(lambda self: False))
    assert run() == fast
    assert fast[1] < 48  # it drafted
