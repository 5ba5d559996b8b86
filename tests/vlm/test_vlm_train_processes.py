"""`mmspec train vlm-drafter` across processes and interruptions: two processes under torchrun (gloo on the CPU)
answer the same rows and train the same drafter as one process (within float order), and a run interrupted after a
checkpoint resumes to the very drafter an uninterrupted run makes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from vlm_dummies import interrupted_at, save_tiny_world_llava

import vlm.train_drafter as vlm_train_drafter
from mmspec.cli import main
from mmspec.testing import torchrun_mmspec
from vlm.user_data import write_example_data


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm-processes")
    save_tiny_world_llava(folder / "target")
    rows = write_example_data(folder / "data", 14)
    return folder, rows


def arguments(folder, rows, name: str, *extra: str) -> list[str]:
    return ["train", "vlm-drafter", "--target", str(folder / "target"), "--data", str(rows), "--eval-prompts", "2",
            "--work-dir", str(folder / f"work-{name}"), "--out", str(folder / name), "--answer-max-tokens", "8",
            "--batch-size", "6", "--lr", "3e-3", "--seed", "0", "--quiet", *extra]


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def test_two_processes_train_the_drafter_one_process_trains(setup):
    folder, rows = setup
    assert main(arguments(folder, rows, "one", "--steps", "8", "--stages", "data,drafter", "--threads", "1")) == 0
    run = torchrun_mmspec(arguments(folder, rows, "two", "--steps", "8", "--stages", "data,drafter,eval", "--threads",
                                    "1"))
    assert run.returncode == 0, run.stderr[-3000:]
    # the sharded answers are the single process's, row for row
    (one_cache,) = (folder / "work-one").glob("answers-*.pt")
    (two_cache,) = (folder / "work-two").glob("answers-*.pt")
    a, b = torch.load(one_cache, weights_only=True), torch.load(two_cache, weights_only=True)
    for key in ("ids", "lengths", "prompt_lengths"):
        assert torch.equal(a[key], b[key]), key
    one, two = weights(folder / "one"), weights(folder / "two")
    moved = sum(float((one[k] - two[k]).norm() ** 2) for k in one) ** 0.5
    scale = sum(float(one[k].norm() ** 2) for k in one) ** 0.5
    assert moved / scale < 1e-6, moved / scale  # (6e-9 on 2026-12-05: float order)
    info = json.loads((folder / "two" / "training.json").read_text())
    assert info["drafter"]["processes"] == 2 and info["eval"]["greedy_equal_to_vanilla"] is True
    # the control: another seed's drafter is far from both (so the tolerance above could fail)
    assert main(arguments(folder, rows, "seed1", "--steps", "8", "--stages", "data,drafter", "--seed", "1",
                          "--threads", "1")) == 0
    other = weights(folder / "seed1")
    assert sum(float((one[k] - other[k]).norm() ** 2) for k in one) ** 0.5 / scale > 100 * moved / scale


def test_a_run_interrupted_after_a_checkpoint_resumes_to_the_same_drafter(setup, monkeypatch):
    """The state a kill leaves (atomic checkpoints every 3 steps) resumes to the drafter, bit for bit, that an
    uninterrupted run makes, with length-grouped batches and the drafter's feature noise."""
    folder, rows = setup
    common = ("--steps", "7", "--checkpoint-every", "3", "--stages", "data,drafter", "--group-by-length")
    assert main(arguments(folder, rows, "whole", *common)) == 0
    real_step = vlm_train_drafter.optimizer_step
    monkeypatch.setattr(vlm_train_drafter, "optimizer_step", interrupted_at(real_step, 5))
    assert main(arguments(folder, rows, "resumed", *common)) == 130
    (state,) = (folder / "work-resumed").glob("eagle-*-state.pt")
    assert torch.load(state, weights_only=True)["step"] == 3
    monkeypatch.setattr(vlm_train_drafter, "optimizer_step", real_step)
    assert main(arguments(folder, rows, "resumed", *common)) == 0
    whole, resumed = weights(folder / "whole"), weights(folder / "resumed")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
