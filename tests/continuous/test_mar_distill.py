"""`mmspec train mar-draft`: the distillation loss compares the draft's diffusion-head outputs with the frozen
target's (zero for a copy of the target, gradients into the draft only), training lowers it, and the command writes a
CSpD pipeline with the source's target and VAE and the distilled draft, refusing bad folders before any work."""

import copy
import json
import tempfile
from pathlib import Path

import torch
from mar_dummies import tiny_mar

from continuous.mar import CSpDPipeline
from continuous.mar.distill import distillation_loss
from continuous.mar.model import MARModel
from continuous.mar.pipeline import MARPipeline
from continuous.mar.train import WORLD_MAR_COMMON, train_mar
from continuous.mar.vae import world_vae
from mmspec.cli import main

SMALL = dict(embed_dim=32, num_heads=2, encoder_depth=1, decoder_depth=1, diffloss_d=1, diffloss_w=32)


def batch(seed: int = 0, b: int = 3, seq: int = 16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, seq, 16, generator=gen), torch.tensor([0, 1, 2])[:b], gen


def test_the_loss_is_zero_for_a_copy_of_the_target_and_trains_only_the_draft():
    target = tiny_mar(0)
    before = copy.deepcopy(target.state_dict())
    loss_fn = distillation_loss(target)
    tokens, labels, gen = batch()
    assert loss_fn(copy.deepcopy(target), tokens, labels, gen, 0.5).item() == 0.0
    draft = tiny_mar(1).train()
    loss = loss_fn(draft, tokens, labels, torch.Generator().manual_seed(0), 0.5)
    assert loss.item() > 0
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.diffloss.parameters())
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_distillation_brings_the_draft_to_the_target():
    target = tiny_mar(0)
    data = {"means": torch.randn(32, 16, 16), "stds": 0.1 * torch.ones(32, 16, 16), "labels": torch.arange(32) % 4}
    loss_fn = distillation_loss(target)
    draft = tiny_mar(1)

    def held_out(model):
        tokens, labels, _ = batch(seed=5)
        with torch.no_grad():
            return loss_fn(model, tokens, labels, torch.Generator().manual_seed(9), 0.6).item()

    with tempfile.TemporaryDirectory() as folder:  # train_mar warm-starts from a saved folder
        draft.save_pretrained(folder)
        trained, _ = train_mar("draft", data, steps=60, batch_size=8, lr=3e-3, ema_rate=0.0, seed=0, quiet=True,
                               init_from=Path(folder), loss_fn=loss_fn)
    assert held_out(trained) < 0.5 * held_out(draft)


def world_mar(seed: int) -> MARModel:
    """A small MAR on the world VAE's token grid (what `encode_world` produces)."""
    torch.manual_seed(seed)
    return MARModel(**{**WORLD_MAR_COMMON, **SMALL})


def world_folder(tmp_path, with_draft: bool = True):
    models = {kind: world_mar(seed) for kind, seed in (("target", 0), ("draft", 1))}
    if with_draft:
        pipe = CSpDPipeline(target=models["target"], draft=models["draft"], vae=world_vae())
    else:
        pipe = MARPipeline(transformer=models["target"], vae=world_vae())
    pipe.save_pretrained(tmp_path / "src")
    return tmp_path / "src"


def test_the_command_writes_a_cspd_pipeline_with_the_distilled_draft(tmp_path, capsys):
    src = world_folder(tmp_path)
    out = tmp_path / "out"
    args = ["train", "mar-draft", "--distill-from", str(src), "--out", str(out), "--work-dir", str(tmp_path / "w"),
            "--steps", "2", "--batch-size", "2", "--num-train-images", "16", "--eval-images-per-class", "1",
            "--threads", "1", "--quiet"]
    assert main(args) == 0
    pipe, source = CSpDPipeline.from_pretrained(out), CSpDPipeline.from_pretrained(src)
    for a, b in zip(pipe.target.parameters(), source.target.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(pipe.draft.parameters(), source.draft.parameters()))
    info = json.loads((out / "training.json").read_text())
    assert info["distilled_draft"]["steps"] == 2 and info["eval"]["draft"]["n"] == 16
    assert "mmspec train mar-draft --distill-from" in (out / "README.md").read_text()
    # bad folders are refused in one line before any work
    assert main(["train", "mar-draft", "--distill-from", str(src), "--out", str(src)]) == 2
    assert "--out must differ" in capsys.readouterr().err
    assert main(["train", "mar-draft", "--distill-from", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert "no model_index.json" in capsys.readouterr().err
    single = world_folder(tmp_path / "single", with_draft=False)
    assert main(["train", "mar-draft", "--distill-from", str(single), "--out", str(tmp_path / "o2")]) == 2
    assert "no draft to start from" in capsys.readouterr().err
