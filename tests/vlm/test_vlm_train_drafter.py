"""`mmspec train vlm-drafter` end to end on a tiny saved world LLaVA: target answers, EagleVLM training (its
feature loss falls), evaluation (greedy EagleVLM == the target alone), the folder the pipeline loads, errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlavaForConditionalGeneration

import vlm.train_drafter as vlm_train_drafter
from mmspec.cli import main
from mmspec.hf_loading import folder_fingerprint
from mmspec.model_card import metadata, strip_metadata
from vlm.family import drafter_model
from vlm.pipeline import SpeculativeVLM
from vlm.world import world_llava_config, world_processor

TINY = dict(vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
            text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm-target")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(world_llava_config(**TINY)).save_pretrained(folder)
    world_processor().save_pretrained(folder)
    return folder


def train(target_dir, work, *extra: str) -> int:
    return main(["train", "vlm-drafter", "--target", str(target_dir), "--work-dir", str(work), "--num-train", "12",
                 "--answer-max-tokens", "8", "--batch-size", "4", "--eval-prompts", "3", "--quiet", *extra])


def test_train_eagle_end_to_end(target_dir, tmp_path):
    assert train(target_dir, tmp_path / "work", "--steps", "60", "--lr", "3e-3") == 0
    out = target_dir / "drafters" / "eagle"
    info = json.loads((out / "training.json").read_text())
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert info["eval"]["mean_acceptance_length"] >= 1.0
    assert info["drafter"]["final_feature_smoothl1"] < info["drafter"]["first_feature_smoothl1"]
    card = (out / "README.md").read_text()
    assert strip_metadata(card).startswith("# VLM drafter (eagle) for the world LLaVA")
    assert metadata(card)["pipeline_tag"] == "image-text-to-text" and metadata(card)["library_name"] == "mmspec"
    assert "llava" in metadata(card)["tags"]
    vlm = SpeculativeVLM.from_pretrained(target_dir, drafter="eagle")
    assert vlm.drafter is not None


def test_a_drafter_card_names_its_targets_architecture():
    assert vlm_train_drafter.target_card_names("llava") == ("LLaVA", "llava")
    assert vlm_train_drafter.target_card_names("qwen2_vl") == ("Qwen2-VL", "qwen2-vl")  # not "the world LLaVA"
    assert vlm_train_drafter.target_card_names("gemma3") == ("gemma3", "gemma3")


def test_the_eval_reads_the_drafters_paper_tree(target_dir, monkeypatch):
    """The card's acceptance is the paper tree's (budget="fixed"), not what a draft budget chose on this machine:
    the eval's spec call drafts the configured tree every step, as a fixed-budget call does."""
    base = SpeculativeVLM.from_pretrained(target_dir)
    torch.manual_seed(0)
    vlm = SpeculativeVLM(base.model, base.processor, drafter_model("eagle").for_target(base.lm))
    calls = []
    real = SpeculativeVLM.generate

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append((kwargs, out))
        return out

    monkeypatch.setattr(SpeculativeVLM, "generate", spy)
    info = vlm_train_drafter.evaluate(vlm, 3, seed=0, max_tokens=8)
    (_, spec), (chain_kwargs, chain), (_, vanilla) = calls
    for out in (spec, chain):
        assert not any(key.startswith("budget_") for key in out.stats.extra)  # no draft budget chose its steps
    assert info["mean_acceptance_length"] == spec.stats.mean_acceptance_length
    assert info["step_compression"] == vanilla.stats.num_target_forwards / spec.stats.num_target_forwards
    # and a greedy chain deeper than the paper trees, whose acceptance they cap
    assert chain_kwargs["tree"] == (info["chain"], 1, info["chain"] + 1) and info["chain"] == 16
    assert info["chain_mean_acceptance_length"] == chain.stats.mean_acceptance_length
    assert info["greedy_equal_to_vanilla"] is True


def test_checkpoint_state_resume_and_errors(target_dir, tmp_path, monkeypatch):
    """An interrupted run leaves its state (named by kind and target) in the work dir, a rerun resumes from it, the
    finished run removes it; the answer cache is named by the target's fingerprint; clear errors."""
    out, work = tmp_path / "drafter", tmp_path / "work"
    fingerprint = folder_fingerprint(target_dir)
    from vlm_dummies import interrupted_at

    real_step = vlm_train_drafter.optimizer_step
    monkeypatch.setattr(vlm_train_drafter, "optimizer_step", interrupted_at(real_step, 3))
    assert train(target_dir, work, "--steps", "4", "--checkpoint-every", "2", "--out", str(out),
                 "--stages", "data,drafter") == 130  # the CLI reports the interruption
    state_path = work / f"eagle-{fingerprint}-state.pt"
    assert torch.load(state_path, weights_only=True)["step"] == 2
    assert len(list(work.glob(f"answers-{fingerprint}-12-*.pt"))) == 1
    assert train(target_dir, work, "--steps", "4", "--lr", "2e-3", "--out", str(out), "--stages", "drafter") == 2
    monkeypatch.setattr(vlm_train_drafter, "optimizer_step", real_step)
    assert train(target_dir, work, "--steps", "4", "--checkpoint-every", "2", "--out", str(out),
                 "--stages", "data,drafter") == 0
    assert not state_path.exists() and (out / "config.json").is_file()
    # another target (other weights): another fingerprint, so neither its answers nor its state are reused
    other = tmp_path / "other-target"
    torch.manual_seed(1)
    LlavaForConditionalGeneration(world_llava_config(**TINY)).save_pretrained(other)
    assert folder_fingerprint(other) != fingerprint
    with pytest.raises(SystemExit, match="2"):
        main(["train", "vlm-drafter", "--kind", "medusa"])
    assert main(["train", "vlm-drafter", "--target", str(target_dir), "--stages", "nope"]) != 0
    assert main(["train", "vlm-drafter", "--target", str(tmp_path / "missing")]) != 0


def test_mmspec_vlm_command(target_dir, tmp_path, capsys):
    """`mmspec vlm`: one question (with the drafter trained above, or vanilla), a resumable job, clear errors."""
    import PIL.Image

    from mmspec.data import generate_batch

    images = generate_batch(3, seed=0, split="test").images
    for i, image in enumerate(images):
        PIL.Image.fromarray(image.permute(1, 2, 0).numpy()).save(tmp_path / f"scene{i}.png")
    (tmp_path / "not-an-image.png").write_text("hello")
    drafter = "none" if not (target_dir / "drafters" / "eagle").is_dir() else "eagle"
    base = ["vlm", "--model", str(target_dir), "--max-new-tokens", "6", "--tree", "3,3,8"]
    assert main([*base, "--image", str(tmp_path / "scene0.png"), "--prompt", "What color is it?",
                 "--drafter", drafter]) == 0
    spec_answer = capsys.readouterr().out.strip()
    assert main([*base, "--image", str(tmp_path / "scene0.png"), "--prompt", "What color is it?",
                 "--drafter", "none"]) == 0
    assert capsys.readouterr().out.strip() == spec_answer  # greedy: the drafter changes nothing

    job = tmp_path / "job.jsonl"
    job.write_text("\n".join(json.dumps({"id": f"q{i}", "image": f"scene{i}.png", "prompt": "What shape is it?"})
                             for i in range(3)) + "\n")
    out = tmp_path / "answers"
    assert main([*base, "--drafter", "none", "--job", str(job), "--out", str(out), "--batch-size", "2"]) == 0
    lines = (out / "answers.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["q0", "q1", "q2"]
    assert main([*base, "--drafter", "none", "--job", str(job), "--out", str(out), "--batch-size", "2"]) == 0  # done
    assert len((out / "answers.jsonl").read_text().splitlines()) == 3
    assert json.loads((out / "stats.json").read_text())["answered_this_run"] == 3  # the run that answered them

    capsys.readouterr()
    assert main([*base, "--image", str(tmp_path / "not-an-image.png"), "--prompt", "?"]) == 2
    assert "not an image file" in capsys.readouterr().err
    assert main([*base, "--image", str(tmp_path / "scene0.png")]) == 2
    assert main([*base, "--tree", "3,3", "--image", str(tmp_path / "scene0.png"), "--prompt", "x"]) == 2


def test_bench_family_vlm(target_dir, tmp_path):
    """`mmspec bench --family vlm` on the tiny target with every drafter kind: all exact at temperature 0, their
    figures and the drafters' image-token counts reported."""
    from vlm.family import DRAFTER_KINDS, drafter_model
    from vlm.pipeline import SpeculativeVLM

    vlm = SpeculativeVLM.from_pretrained(target_dir)
    for kind, cls in ((k, drafter_model(k)) for k in DRAFTER_KINDS):
        if not (target_dir / "drafters" / kind).is_dir():
            cls.for_target(vlm.lm).save_pretrained(target_dir / "drafters" / kind)
    tree = ":depth=3:top_k=3:total_tokens=8:budget=fixed"  # the drafter runs in every call (auto may skip it)
    out = tmp_path / "bench"
    assert main(["bench", "--family", "vlm", "--methods", "vanilla," + ",".join(k + tree for k in DRAFTER_KINDS),
                 "--batch-sizes", "1,3", "--repeats", "1", "--warmup", "0", "--num-samples", "3",
                 "--max-new-tokens", "8", "--temperature", "0", "--family-option", f"model={target_dir}",
                 "--no-plots", "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for block in summary["batch_sizes"]:
        for kind, attended in (("eagle", 64), ("vispec", 1), ("msd", 64), ("specvlm", None)):
            method = [m for m in block["methods"] if m["method"].startswith(kind)][0]
            assert method["quality"]["exactness"] == 1.0 and method["lossless"] is True
            assert "answer_contains_short" in method["quality"]
            if attended is not None:
                assert method["quality"]["drafter_image_tokens_per_row"] == attended
            else:
                assert 0 <= method["quality"]["drafter_image_tokens_per_row"] <= 16
    n_methods = 1 + len(DRAFTER_KINDS)
    assert len((out / "results.jsonl").read_text().splitlines()) == n_methods * 3 * 2  # x samples x batch sizes


def test_bench_reports_token_calibration_of_sampled_answers(target_dir, tmp_path):
    """At temperature 1 each answer (its EOS included) is scored under the target: the figures count every
    generated token, and the lossless tree method's tokens are not told apart from exact draws."""
    from vlm.family import drafter_model
    from vlm.pipeline import SpeculativeVLM

    if not (target_dir / "drafters" / "eagle").is_dir():
        drafter_model("eagle").for_target(SpeculativeVLM.from_pretrained(target_dir).lm).save_pretrained(
            target_dir / "drafters" / "eagle")
    out = tmp_path / "bench"
    assert main(["bench", "--family", "vlm", "--methods", "vanilla,eagle:depth=3:top_k=3:total_tokens=8",
                 "--batch-sizes", "3", "--repeats", "1", "--warmup", "0", "--num-samples", "6",
                 "--max-new-tokens", "24", "--temperature", "1", "--family-option", f"model={target_dir}",
                 "--no-plots", "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for method in summary["batch_sizes"][0]["methods"]:
        answers = [r["choices"][0]["turns"][0]["token_ids"] for r in records if r["method"] == method["method"]]
        q = method["quality"]
        assert q["calibration_tokens"] == sum(len(a) for a in answers) > 0
        assert q["pit_ks_pvalue"] > 0.001 and q["off_support"] == 0.0


def test_train_vispec(target_dir, tmp_path):
    out = tmp_path / "vispec"
    assert train(target_dir, tmp_path / "work", "--kind", "vispec", "--steps", "40", "--lr", "3e-3",
                 "--out", str(out)) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["drafter"]["text_only_steps"] == 20  # half the steps: the official code's two equal runs
    assert info["drafter"]["input_norm"] is False and info["drafter"]["answers"] == "target"
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert info["drafter"]["final_feature_smoothl1"] < info["drafter"]["first_feature_smoothl1"]
    from vlm.pipeline import SpeculativeVLM
    from vlm.vispec import VLMViSpecDrafter

    vlm = SpeculativeVLM.from_pretrained(target_dir, "vispec", drafter_path=out)
    assert isinstance(vlm.drafter, VLMViSpecDrafter)


def test_train_msd(target_dir, tmp_path):
    out = tmp_path / "msd"
    assert train(target_dir, tmp_path / "work", "--kind", "msd", "--steps", "40", "--lr", "3e-3",
                 "--out", str(out)) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["drafter"]["answers"] == "dataset" and info["drafter"]["input_norm"] is False  # MSD's code
    assert info["drafter"]["noise_scaling"] == "eagle"
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert info["drafter"]["final_feature_smoothl1"] < info["drafter"]["first_feature_smoothl1"]


def test_train_specvlm(target_dir, tmp_path):
    out = tmp_path / "specvlm"
    assert train(target_dir, tmp_path / "work", "--kind", "specvlm", "--steps", "40", "--lr", "3e-3",
                 "--out", str(out)) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert info["drafter"]["final_feature_smoothl1"] < info["drafter"]["first_feature_smoothl1"]


def test_text_only_batch_runs_the_target_without_the_image(target_dir, tmp_path):
    """The text stage (ViSpec stage 1, MSD's first epochs): the sequences without their image tokens and without
    pixels, the answer positions still the ones that count."""
    from vlm.drafter_data import answer_cache
    from vlm.train_drafter import training_batch

    vlm = SpeculativeVLM.from_pretrained(target_dir)
    args = vlm_train_drafter.argparse.Namespace(target=str(target_dir), num_train=4, seed=0, answer_max_tokens=6,
                                                force=False, quiet=True, answers="target", kind="eagle")
    data = answer_cache(vlm, args, tmp_path)
    rows = torch.tensor([0, 1])
    full, full_mask = training_batch(vlm, data, rows)
    text, text_mask = training_batch(vlm, data, rows, text_only=True)
    image = vlm.lm.image_token_id
    assert text.pixel_values is None and not (text.input_ids == image).any()
    n_image = int((full.input_ids[0] == image).sum())
    assert (full.lengths - text.lengths).tolist() == [n_image, n_image]
    assert full_mask.sum() == text_mask.sum()  # the same answer tokens are predicted
    for b in range(2):
        kept = full.input_ids[b][full.input_ids[b] != image][: int(text.lengths[b])]
        assert text.input_ids[b, : int(text.lengths[b])].tolist() == kept.tolist()


def test_feature_noise_follows_eagles_length_scaling():
    from vlm.drafter_losses import feature_noise

    features, lengths = torch.zeros(2, 64, 8), torch.tensor([64, 256])
    noise = feature_noise(features, lengths, 0.2, "eagle", torch.Generator().manual_seed(0))
    for b, length in enumerate((64, 256)):
        half_width = 0.5 * 0.2 * 512 / length
        assert noise[b].abs().max() <= half_width and noise[b].abs().max() > 0.9 * half_width
    fixed = feature_noise(features, lengths, 0.2, "fixed", torch.Generator().manual_seed(0))
    assert 0.09 < fixed.abs().max() <= 0.1


@pytest.mark.parametrize("kind", ["eagle", "vispec", "specvlm"])
def test_train_a_drafter_for_a_qwen2_vl_target(tmp_path, kind):
    """`mmspec train vlm-drafter` on a (tiny, untrained) Qwen2-VL folder: world prompts get Qwen2-VL's image
    marker, image batches carry image_grid_thw; the drafter trains, saves, loads and keeps greedy answers exact."""
    from transformers import Qwen2VLForConditionalGeneration

    from vlm.world_qwen2_vl import world_qwen2_vl_config, world_qwen2_vl_processor

    folder = tmp_path / "qwen2-vl"
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(world_qwen2_vl_config(
        vision=dict(depth=1, embed_dim=32, num_heads=2),
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2))).save_pretrained(folder)
    world_qwen2_vl_processor().save_pretrained(folder)
    assert train(folder, tmp_path / "work", "--kind", kind, "--steps", "12", "--text-only-fraction", "0.5") == 0
    info = json.loads((folder / "drafters" / kind / "training.json").read_text())
    assert info["eval"]["greedy_equal_to_vanilla"] is True
    assert SpeculativeVLM.from_pretrained(folder, drafter=kind).drafter is not None


def test_the_text_stage_trains_on_a_text_corpus(target_dir, tmp_path):
    """`--text-data FILE` (ViSpec's / MSD's separate text corpus): the world corpus writer's ShareGPT file trains
    ViSpec's text stage on its conversations (the prompt formatted without an image, the dataset's reply learnt);
    the same run without it trains on the multimodal sequences; bad files and kinds without a text stage are one-line
    errors before the model loads."""
    from vlm.text_data import main as write_corpus
    from vlm.text_data import read_text_conversations, text_corpus

    corpus = tmp_path / "text.jsonl"
    assert write_corpus([str(corpus), "--num", "16"]) == 0
    pairs, notice = read_text_conversations(corpus)
    assert len(pairs) == 16 and pairs[0][0].endswith("Answer in detail.") and notice is None
    two = {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."},
                             {"from": "human", "value": "And?"}, {"from": "gpt", "value": "Bye."}]}
    (tmp_path / "turns.jsonl").write_text(corpus.read_text() + json.dumps(two) + "\n")
    pairs2, notice = read_text_conversations(tmp_path / "turns.jsonl")
    assert pairs2[-1] == ("Hi?", "Hello.") and "1 of 17 rows hold more than one exchange" in notice
    vlm = SpeculativeVLM.from_pretrained(target_dir)
    data = text_corpus(vlm, pairs, 8)
    tok = vlm.processor.tokenizer
    assert not (data["ids"] == vlm.lm.image_token_id).any()
    first = data["ids"][0, : int(data["lengths"][0])].tolist()
    assert tok.decode(first[int(data["prompt_lengths"][0]):]).startswith(tok.decode(tok(pairs[0][1],
                                                                                      add_special_tokens=False)
                                                                                  ["input_ids"][:3]))
    out = tmp_path / "vispec"
    assert train(target_dir, tmp_path / "work", "--kind", "vispec", "--steps", "20", "--lr", "3e-3", "--out", str(out),
                 "--text-data", str(corpus), "--stages", "data,drafter") == 0
    info = json.loads((out / "training.json").read_text())["drafter"]
    assert info["text_data"] == str(corpus) and info["text_data_rows"] == 16 and info["text_only_steps"] == 10
    (tmp_path / "bad.jsonl").write_text('{"conversations": [{"from": "gpt", "value": "x"}]}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    for extra, message in ((["--kind", "vispec", "--text-data", str(tmp_path / "bad.jsonl")], "line 1: no user turn"),
                           (["--kind", "vispec", "--text-data", str(tmp_path / "binary.jsonl")], "not UTF-8"),
                           (["--kind", "vispec", "--text-data", str(tmp_path / "none.jsonl")], "no such file"),
                           (["--kind", "eagle", "--text-data", str(corpus)], "trains on multimodal sequences only")):
        with pytest.raises(Exception, match=message) as err:
            vlm_train_drafter.run(vlm_train_drafter_args(target_dir, tmp_path, extra))
        assert "\n" not in str(err.value)


def vlm_train_drafter_args(target_dir, tmp_path, extra: list[str]):
    """`mmspec train vlm-drafter` arguments as its parser reads them."""
    import argparse

    parser = argparse.ArgumentParser()
    vlm_train_drafter.add_arguments(parser)
    return parser.parse_args(["--target", str(target_dir), "--work-dir", str(tmp_path / "work"), *extra])
