"""Adapters for real-checkpoint metrics (Inception FID, CLIP score): local weights only, never the network.

What runs offline here: the missing/invalid-weights errors, CLIP score end to end with a tiny open_clip
config and random weights (checked against a direct computation), and (slow) Inception FID end to end with
randomly initialised weights of torch-fidelity's exact Inception architecture. Not testable offline: the
figures with the real pretrained weights.
"""

from __future__ import annotations

import argparse
import json
import socket
from unittest import mock

import pytest
import torch

from mmspec.data import generate_batch
from mmspec.errors import CheckpointError, InputError
from mmspec.metrics import clip_score, inception_fid

TINY_CLIP = "mmspec-test-tiny-clip"
TINY_CLIP_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A registered tiny open_clip config and a random-weights safetensors file for it."""
    import open_clip
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("clip")
    (folder / f"{TINY_CLIP}.json").write_text(json.dumps(TINY_CLIP_CONFIG))
    open_clip.add_model_config(folder / f"{TINY_CLIP}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_CLIP)
    weights = folder / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return weights


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", [None, "", "/nonexistent/inception.pth"])
def test_inception_fid_needs_a_local_weights_file(bad):
    images = generate_batch(4, seed=0, split="val").images
    with pytest.raises(InputError, match="weights_path"):
        inception_fid(images, images, bad)


def test_inception_fid_rejects_a_folder_as_weights(tmp_path):
    images = generate_batch(4, seed=0, split="val").images
    with pytest.raises(InputError, match="is a folder"):
        inception_fid(images, images, tmp_path)


def test_inception_fid_rejects_unsafe_or_mismatched_weights(tmp_path, no_network):
    images = generate_batch(4, seed=0, split="val").images
    unsafe = tmp_path / "pickled.pth"
    torch.save({"x": argparse.Namespace(code="arbitrary object")}, unsafe)  # not a plain tensor file
    with pytest.raises(CheckpointError, match="weights-only"):
        inception_fid(images, images, unsafe)
    wrong = tmp_path / "wrong.pth"
    torch.save({"fc.weight": torch.zeros(2, 2)}, wrong)
    with pytest.raises(CheckpointError, match="does not match"):
        inception_fid(images, images, wrong)


def test_clip_score_errors(tmp_path, tiny_clip):
    batch = generate_batch(3, seed=0, split="val")
    with pytest.raises(InputError, match="weights_path"):
        clip_score(batch.images, batch.captions, TINY_CLIP, tmp_path / "missing.safetensors")
    with pytest.raises(InputError, match="weights_path"):
        clip_score(batch.images, batch.captions, TINY_CLIP, None)
    with pytest.raises(InputError, match="schema"):
        clip_score(batch.images, batch.captions, "hf-hub:someone/clip", tiny_clip)
    with pytest.raises(InputError, match="not an open_clip config"):
        clip_score(batch.images, batch.captions, "no-such-model", tiny_clip)
    with pytest.raises(InputError, match="download"):
        clip_score(batch.images, batch.captions, "ViT-B-16-SigLIP", tiny_clip)
    with pytest.raises(InputError, match="one text per image"):
        clip_score(batch.images, batch.captions[:2], TINY_CLIP, tiny_clip)


# --------------------------------------------------------------------------------------------- computations
def test_clip_score_runs_offline_and_matches_direct_computation(tiny_clip, no_network):
    import open_clip

    batch = generate_batch(6, seed=0, split="val")
    result = clip_score(batch.images, batch.captions, TINY_CLIP, tiny_clip, batch_size=4)
    assert result.n == 6 and 0 <= float(result) <= 100
    model = open_clip.create_model(TINY_CLIP, pretrained=str(tiny_clip)).eval()
    cfg = open_clip.get_model_preprocess_cfg(model)
    mean, std = torch.tensor(cfg["mean"]).view(1, 3, 1, 1), torch.tensor(cfg["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        img = model.encode_image((batch.float_images() - mean) / std)
        txt = model.encode_text(open_clip.get_tokenizer(TINY_CLIP)(batch.captions))
    cos = torch.nn.functional.cosine_similarity(img, txt)
    assert result.score == pytest.approx(float((100 * cos).clamp(min=0).mean()), abs=1e-4)


def _random_inception_weights(path) -> None:
    """torch-fidelity's exact Inception-v3 with random (variance-preserving) weights, saved as safetensors."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe
    from safetensors.torch import save_file

    with (
        mock.patch.object(fe, "load_state_dict_from_url", lambda *a, **k: {}),
        mock.patch.object(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd, *a, **k: None),
    ):
        model = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


@pytest.mark.slow
def test_inception_fid_runs_offline_with_local_weights(tmp_path, no_network):
    from PIL import Image

    weights = tmp_path / "inception.safetensors"
    _random_inception_weights(weights)
    real = generate_batch(6, seed=0, split="val").images
    other = generate_batch(6, seed=1, split="val").images
    same = inception_fid(real, real, weights)
    assert (same.n_generated, same.n_reference) == (6, 6) and same.fid == pytest.approx(0, abs=1e-3)
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i, img in enumerate(other):
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(folder / f"{i:03d}.png")
    apart = inception_fid(real, folder, weights)
    assert apart.fid > 1e-3 and apart.n_reference == 6
