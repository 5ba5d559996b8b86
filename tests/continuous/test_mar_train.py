"""`mmspec train mar` end to end with a handful of steps (the real run is recorded in assets/mar/README.md), and
its resumable training state: an interrupted run resumed from its checkpoint equals an uninterrupted one."""

import json

import pytest
import torch

import continuous.mar.train as mar_train
from continuous.mar import CSpDPipeline
from continuous.mar.diffusion import respaced_timesteps
from mmspec.cli import main
from mmspec.errors import InputError


def test_train_mar_writes_a_cspd_pipeline_with_a_card(tmp_path):
    out = tmp_path / "mar"
    assert main(["train", "mar", "--out", str(out), "--work-dir", str(tmp_path / "work"), "--vae-steps", "2",
                 "--target-steps", "2", "--draft-steps", "2", "--num-train-images", "64", "--mar-batch-size", "4",
                 "--vae-scale-images", "64", "--recon-eval-images", "64", "--eval-images-per-class", "1",
                 "--eval-sampling-steps", "5", "--eval-num-iter", "8", "--threads", "1", "--quiet"]) == 0
    for part in ("model_index.json", "README.md", "training.json", "vae", "target", "draft"):
        assert (out / part).exists()
    info = json.loads((out / "training.json").read_text())
    assert set(info["eval"]) == {"target", "draft"} and info["eval"]["target"]["n"] == 16
    assert info["recon"]["n"] == 64 and info["vae"]["scale_images"] == 64
    card = (out / "README.md").read_text()
    assert "mmspec train mar --out" in card and "--eval-sampling-steps 5" in card and "5 diffusion steps" in card
    assert "--recon-eval-images 64" in card and "--eval-num-iter 8" in card and "num_iter = 8," in card
    pipe = CSpDPipeline.from_pretrained(out)
    assert pipe.target.num_parameters() > 3 * pipe.draft.num_parameters()
    assert pipe.target.config.timestep_spacing == "leading" and pipe.target.seq_len == 64


def test_an_interrupted_training_resumes_to_the_same_weights(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    data = {"means": torch.randn(16, 64, 16, generator=gen), "stds": 0.1 * torch.ones(16, 64, 16),
            "labels": torch.arange(16) % 16}
    kw = dict(steps=4, batch_size=2, lr=1e-3, ema_rate=0.9, seed=0, quiet=True, checkpoint_every=2)
    whole, _ = mar_train.train_mar("draft", data, state_path=tmp_path / "a.pt", **kw)
    assert not (tmp_path / "a.pt").exists()  # removed once the run is complete

    real_step = mar_train.optimizer_step

    def crash_at_step_3(opt, loss, step, *args):
        if step == 3:
            raise KeyboardInterrupt
        real_step(opt, loss, step, *args)

    monkeypatch.setattr(mar_train, "optimizer_step", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        mar_train.train_mar("draft", data, state_path=tmp_path / "b.pt", **kw)
    assert torch.load(tmp_path / "b.pt", weights_only=True)["step"] == 2
    monkeypatch.setattr(mar_train, "optimizer_step", real_step)
    resumed, _ = mar_train.train_mar("draft", data, state_path=tmp_path / "b.pt", **kw)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_target_arch_overrides_the_world_architecture(tmp_path, capsys):
    arch = mar_train.parse_arch(["embed_dim=96", "decoder_depth=1"])
    assert arch == {**mar_train.WORLD_MAR["target"], "embed_dim": 96, "decoder_depth": 1}
    data = {"means": torch.randn(8, 64, 16), "stds": 0.1 * torch.ones(8, 64, 16), "labels": torch.arange(8)}
    model, info = mar_train.train_mar("target", data, steps=1, batch_size=2, lr=1e-3, ema_rate=0.9, seed=0,
                                      quiet=True, arch=arch)
    assert model.config.embed_dim == 96 and len(model.decoder_blocks) == 1 and info["arch"] == arch
    assert info["parameters"] == model.num_parameters()
    # a bad --device is refused before any stage runs
    args = ["train", "mar", "--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w"), "--device", "gpu"]
    assert main(args) == 2
    assert "device must be cpu or cuda, got 'gpu'" in capsys.readouterr().err and not (tmp_path / "o").exists()
    for pairs, message in ((["width=3"], "KEY one of"), (["embed_dim=0"], "positive integer"),
                           (["embed_dim"], "KEY=VALUE"), (["embed_dim=90"], "multiple of num_heads")):
        with pytest.raises(InputError, match=message):
            mar_train.parse_arch(pairs)


def test_timestep_spacings():
    assert respaced_timesteps(100, spacing="leading")[-1].item() == 990
    assert respaced_timesteps(100)[-1].item() == 999
    with pytest.raises(InputError, match="timestep_spacing must be one of"):
        respaced_timesteps(10, spacing="trailing")


def test_mask_rates_follow_the_truncated_normal():
    from scipy import stats

    from continuous.mar.model import truncated_mask_rate

    gen = torch.Generator().manual_seed(0)
    rates = [truncated_mask_rate(0.7, gen) for _ in range(2000)]
    assert min(rates) >= 0.7 and max(rates) <= 1.0
    assert stats.kstest(rates, stats.truncnorm(-1.2, 0, loc=1.0, scale=0.25).cdf).pvalue > 1e-3


def test_cosine_mask_rates_cover_the_late_generation_steps():
    from continuous.mar.model import cosine_mask_rate

    gen = torch.Generator().manual_seed(0)
    rates = torch.tensor([cosine_mask_rate(gen) for _ in range(4000)])
    assert rates.min() >= 0 and rates.max() <= 1
    # P(rate < 0.3) = 1 - 2 acos(0.3) / pi ~ 0.194; the official truncated normal never goes below 0.7
    assert abs((rates < 0.3).float().mean().item() - 0.194) < 0.03


def test_sincos_position_init_gives_every_token_a_distinct_position():
    from mar_dummies import tiny_mar

    from continuous.mar.model import sincos_2d

    table = sincos_2d(32, 4)  # [16, 32]
    assert table.shape == (16, 32) and torch.cdist(table, table).add(torch.eye(16)).min() > 0.1
    model = tiny_mar(0, pos_embed_init="sincos")
    assert torch.equal(model.decoder_pos_embed_learned[0, -16:], table)
    assert torch.equal(model.diffusion_pos_embed_learned[0], table)
    assert tiny_mar(0).encoder_pos_embed_learned.std() < 0.05  # the official normal(0.02) init by default
