"""`mmspec train var` and `mmspec train var-code` end to end with a handful of steps (the real runs are recorded in
assets/var/README.md), and the fine-tuning losses: masked to the right scales, distillation minimal at the teacher."""

import json

import pytest
import torch
from var_dummies import PNS, get_dummy_components

from image_ar.var import VARTransformer
from image_ar.var.code import CoDePipeline
from image_ar.var.train_code import distillation, masked_cross_entropy, scale_mask
from mmspec.cli import main
from mmspec.model_card import metadata, strip_metadata


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-var")
    out = root / "var"
    assert main(["train", "var", "--out", str(out), "--work-dir", str(root / "work"), "--vqvae-steps", "2",
                 "--large-steps", "2", "--small-steps", "2", "--num-train-images", "128", "--recon-eval-images", "64",
                 "--vqvae-batch-size", "16", "--var-batch-size", "8",
                 "--eval-images-per-class", "1", "--threads", "1", "--no-compile", "--quiet"]) == 0
    return root, out


def test_train_var_writes_a_code_pipeline_with_a_card(trained):
    _, out = trained
    for part in ("model_index.json", "README.md", "training.json", "vqvae", "drafter", "refiner"):
        assert (out / part).exists()
    info = json.loads((out / "training.json").read_text())
    assert set(info["eval"]) == {"large", "small", "code"} and info["eval"]["code"]["n"] == 16
    assert info["recon"]["n"] == 64
    card = (out / "README.md").read_text()
    assert "mmspec train var --out" in card and "judge class accuracy" in card
    pipe = CoDePipeline.from_pretrained(out)
    assert pipe.drafter.num_parameters() > 4 * pipe.refiner.num_parameters()
    assert pipe.vqvae.image_size == 32


def test_train_var_code_fine_tunes_into_a_new_folder(trained, tmp_path):
    root, source = trained
    out = tmp_path / "code"
    assert main(["train", "var-code", "--pipeline", str(source), "--out", str(out), "--work-dir", str(root / "work"),
                 "--num-train-images", "128", "--large-steps", "2", "--distill-steps", "2", "--refine-steps", "2",
                 "--batch-size", "8", "--eval-images-per-class", "1", "--threads", "1", "--no-compile", "--quiet"]) == 0
    before, after = CoDePipeline.from_pretrained(source), CoDePipeline.from_pretrained(out)
    changed = lambda a, b: any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert changed(before.drafter, after.drafter) and changed(before.refiner, after.refiner)
    assert not changed(before.vqvae, after.vqvae)
    info = json.loads((out / "training.json").read_text())
    assert info["draft_steps"] == 5 and {"before", "after", "large", "distill", "refine"} <= set(info)
    assert main(["train", "var-code", "--pipeline", str(source), "--out", str(source)]) == 2


def test_train_var_code_refiner_only_from_codes_keeps_the_training_free_refiner(trained, tmp_path):
    """--small-target codes with the large and distill stages off: only the refiner changes, the source's refiner is
    kept in refiner_training_free/ (loadable as the training-free pair), and the card extends the source's."""
    root, source = trained
    out = tmp_path / "refined"
    assert main(["train", "var-code", "--pipeline", str(source), "--out", str(out), "--work-dir", str(root / "work"),
                 "--num-train-images", "128", "--large-steps", "0", "--distill-steps", "0", "--refine-steps", "3",
                 "--small-target", "codes", "--eval-images-per-class", "1", "--threads", "1", "--no-compile",
                 "--quiet"]) == 0
    before, after = CoDePipeline.from_pretrained(source), CoDePipeline.from_pretrained(out)
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert same(before.drafter, after.drafter) and not same(before.refiner, after.refiner)
    kept = VARTransformer.from_pretrained(out, subfolder="refiner_training_free")
    assert same(before.refiner, kept)
    training_free = CoDePipeline.from_pretrained(out, refiner=kept)
    assert same(training_free.refiner, before.refiner)
    info = json.loads((out / "training.json").read_text())
    assert {"refine"} <= set(info) and not {"large", "distill"} & set(info) and info["small_target"] == "codes"
    assert info["source_training"] == json.loads((source / "training.json").read_text())
    card = (out / "README.md").read_text()
    assert strip_metadata(card).startswith(strip_metadata((source / "README.md").read_text()).rstrip("\n"))
    assert metadata(card)["pipeline_tag"] == "unconditional-image-generation" and card.count("\n---\n") == 1
    assert "--small-target codes" in card and "refiner_training_free/" in card


def test_masked_losses_see_only_their_scales():
    model = get_dummy_components()["transformer"]
    mask = scale_mask(model, 0, 2)  # scales 0 and 1: the first 1 + 4 positions of 21
    assert mask.tolist() == [True] * 5 + [False] * 16
    torch.manual_seed(0)
    code = torch.randint(0, 16, (2, model.num_tokens))
    inputs, labels = torch.randn(2, model.num_tokens - 1, 4), torch.tensor([0, 1])
    other = code.clone()
    other[:, 5:] = (other[:, 5:] + 1) % 16  # change only the codes of the unmasked scales
    loss = masked_cross_entropy(mask)
    assert torch.equal(loss(model, code, labels, inputs), loss(model, other, labels, inputs))
    assert not torch.equal(masked_cross_entropy(~mask)(model, code, labels, inputs),
                           masked_cross_entropy(~mask)(model, other, labels, inputs))


def test_distillation_is_smallest_for_the_teacher_itself():
    teacher = get_dummy_components()["transformer"]
    torch.manual_seed(3)
    student = VARTransformer(vocab_size=16, cvae=4, num_classes=3, depth=1, embed_dim=8, num_heads=2,
                             patch_nums=PNS).eval()
    mask = scale_mask(teacher, 1, len(PNS))
    code = torch.randint(0, 16, (3, teacher.num_tokens))
    inputs, labels = torch.randn(3, teacher.num_tokens - 1, 4), torch.tensor([0, 1, 3])  # 3 = the null class
    loss = distillation(teacher, mask)
    assert loss(teacher, code, labels, inputs) < loss(student, code, labels, inputs)  # Gibbs' inequality
