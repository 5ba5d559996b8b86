"""Tests for mmspec.checkpoints: safe loading, container unwrapping, key surgery, strict loading, saving."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mmspec.checkpoints import (
    LoadReport,
    add_prefix,
    default_safe_globals,
    drop_keys,
    extract_state_dict,
    load_checkpoint,
    load_into,
    load_state_dict,
    rename_keys,
    save_safetensors,
    strip_prefix,
    unused_rename_rules,
)
from mmspec.errors import CheckpointError, InputError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md"
_SIDE_EFFECTS: list[str] = []


def _sd(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(3, generator=g)}


def _assert_sd_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


class Custom:
    """A class no allow-list knows."""

    def __init__(self) -> None:
        self.value = 1


def _record_side_effect(what: str) -> None:
    _SIDE_EFFECTS.append(what)


class Exploit:
    """Unpickling this runs code; safe loading must refuse it before anything runs."""

    def __reduce__(self):
        return (_record_side_effect, ("ran",))


class Net(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 8)
        self.fc2 = nn.Linear(8, 2)
        self.register_buffer("freqs_cis", torch.zeros(5))


# --------------------------------------------------------------------------------------------- safetensors
def test_save_safetensors_round_trip(tmp_path: Path) -> None:
    sd = _sd()
    out = save_safetensors(sd, tmp_path / "sub" / "w.safetensors", metadata={"format": "pt"})
    assert out == tmp_path / "sub" / "w.safetensors"
    _assert_sd_equal(load_state_dict(out), sd)
    assert [p.name for p in out.parent.iterdir()] == ["w.safetensors"]  # no temporary file left behind


def test_save_safetensors_tied_and_noncontiguous(tmp_path: Path) -> None:
    w = torch.randn(4, 6)
    sd = {"emb.weight": w, "head.weight": w, "t": w.t(), "half": w[:2]}
    save_safetensors(sd, tmp_path / "tied.safetensors")
    got = load_state_dict(tmp_path / "tied.safetensors")
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


def test_save_safetensors_replaces_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_safetensors(_sd(0), path)
    save_safetensors(_sd(1), path)
    _assert_sd_equal(load_state_dict(path), _sd(1))


def test_save_safetensors_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"\.safetensors"):
        save_safetensors(_sd(), tmp_path / "w.pt")
    with pytest.raises(InputError, match="'x'"):
        save_safetensors({"x": 3}, tmp_path / "w.safetensors")
    with pytest.raises(InputError, match="metadata"):
        save_safetensors(_sd(), tmp_path / "w.safetensors", metadata={"epoch": 3})
    assert not list(tmp_path.iterdir())


def test_shard_directory_with_index(tmp_path: Path) -> None:
    sd = {**_sd(0), "b.weight": torch.randn(2, 2)}
    save_file({k: sd[k] for k in ("a.weight",)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in ("a.bias", "b.weight")}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "a.bias": "model-00002-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text("{}")
    _assert_sd_equal(load_state_dict(tmp_path), sd)

    weight_map["c.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="c.weight"):
        load_checkpoint(tmp_path)
    weight_map["d.weight"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00003-of-00003"):
        load_checkpoint(tmp_path)


def test_shard_directory_without_index(tmp_path: Path) -> None:
    save_file({"x": torch.ones(2)}, tmp_path / "part1.safetensors")
    save_file({"y": torch.zeros(2)}, tmp_path / "part2.safetensors")
    assert set(load_checkpoint(tmp_path)) == {"x", "y"}
    save_file({"x": torch.ones(2)}, tmp_path / "part3.safetensors")
    with pytest.raises(CheckpointError, match="'x'.*part1.*part3"):
        load_checkpoint(tmp_path)


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="No weights in directory") as err:
        load_checkpoint(tmp_path)
    assert "config.json" in str(err.value)
    torch.save(_sd(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------- official containers
@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: {"model": sd},  # LlamaGen c2i_*.pt, kl16.ckpt
        lambda sd: {"module": sd},
        lambda sd: {"state_dict": sd, "epoch": 1},
        lambda sd: sd,  # VAR, VQ/VAE: raw
        lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}},  # DDP
        lambda sd: {f"_orig_mod.{k}": v for k, v in sd.items()},  # torch.compile
        lambda sd: {"state_dict": {"model": sd}},  # nested container
    ],
    ids=["model", "module", "state_dict", "raw", "ddp", "compiled", "nested"],
)
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt", ".bin"])
def test_llamagen_style_containers(tmp_path: Path, wrap, suffix: str) -> None:
    sd = _sd()
    path = tmp_path / f"ckpt{suffix}"
    torch.save(wrap(sd), path)
    _assert_sd_equal(load_state_dict(path), sd)


def _mar_checkpoint() -> dict:
    # what AdamW.state_dict() holds (built by hand: constructing an optimizer imports torch._dynamo, ~1 s)
    optimizer = {
        "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}},
        "param_groups": [
            {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.02, "amsgrad": False, "params": [0]}
        ],
    }
    return {
        "model": _sd(0),
        "model_ema": _sd(1),
        "optimizer": optimizer,
        "epoch": np.int64(5),
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "_growth_tracker": 0},
        "args": argparse.Namespace(model="mar_base", img_size=256, lr=np.float64(1e-4), betas=[0.9, 0.95]),
        "rng": np.random.RandomState(0).get_state(),  # tuple with a uint32 array
    }


def test_mar_style_checkpoint_loads_without_opt_in(tmp_path: Path) -> None:
    torch.save(_mar_checkpoint(), tmp_path / "checkpoint-last.pth")
    obj = load_checkpoint(tmp_path / "checkpoint-last.pth")
    assert obj["epoch"] == 5 and isinstance(obj["epoch"], np.int64)
    assert isinstance(obj["args"], argparse.Namespace) and obj["args"].model == "mar_base"
    assert obj["args"].lr == pytest.approx(1e-4)
    assert obj["scaler"]["scale"] == 65536.0
    _assert_sd_equal(extract_state_dict(obj), _sd(1))  # 'model_ema' wins
    _assert_sd_equal(extract_state_dict(obj, prefer="model"), _sd(0))
    _assert_sd_equal(load_state_dict(tmp_path / "checkpoint-last.pth", keys=("model",)), _sd(0))


def test_numpy1_pickled_names_load(tmp_path: Path) -> None:
    """Files written under numpy 1.x name `numpy.core.multiarray.*`; they must load under numpy 2 too."""
    buf = io.BytesIO()
    torch.save({"epoch": np.int64(7), "arr": np.arange(3, dtype=np.float32)}, buf, _use_new_zipfile_serialization=False)
    raw = buf.getvalue()
    if b"numpy._core.multiarray" in raw:
        raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    (tmp_path / "np1.pt").write_bytes(raw)
    obj = load_checkpoint(tmp_path / "np1.pt")
    assert obj["epoch"] == 7 and obj["arr"].tolist() == [0.0, 1.0, 2.0]
    names = {g[1] for g in default_safe_globals() if isinstance(g, tuple)}
    assert {"numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar"} <= names


# --------------------------------------------------------------------------------------------- refusals
def test_custom_class_is_refused_with_a_clear_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "custom.pt"
    torch.save({"model": _sd(), "state": Custom()}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert f"{__name__}.Custom" in message and "allow_pickle=True" in message
    assert "not allow-listed" in message and "arbitrary code" in message and str(path) in message

    with caplog.at_level(logging.WARNING, logger="mmspec.checkpoints"):
        obj = load_checkpoint(path, allow_pickle=True)
    assert isinstance(obj["state"], Custom)
    assert any("allow_pickle=True" in r.getMessage() for r in caplog.records)
    assert isinstance(load_checkpoint(path, extra_safe_globals=[Custom])["state"], Custom)


def test_refusal_runs_no_code(tmp_path: Path) -> None:
    for legacy in (False, True):
        path = tmp_path / f"exploit{legacy}.pt"
        torch.save({"model": _sd(), "x": Exploit()}, path, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(CheckpointError, match="_record_side_effect"):
            load_checkpoint(path)
    assert _SIDE_EFFECTS == []


def test_object_arrays_are_refused(tmp_path: Path) -> None:
    torch.save({"model": _sd(), "a": np.array([1, "x"], dtype=object)}, tmp_path / "obj.pt")
    with pytest.raises(CheckpointError, match="ObjectDType"):
        load_checkpoint(tmp_path / "obj.pt")


def test_user_safe_globals_survive_a_load(tmp_path: Path) -> None:
    torch.save(_mar_checkpoint(), tmp_path / "mar.pth")
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        load_checkpoint(tmp_path / "mar.pth")
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert set(torch.serialization.get_safe_globals()) == set(before)
    with pytest.raises(InputError, match="extra_safe_globals"):
        load_checkpoint(tmp_path / "mar.pth", extra_safe_globals=["argparse.Namespace"])


# ------------------------------------------------------------------------------------------- file errors
def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "nope.pt"))):
        load_checkpoint(tmp_path / "nope.pt")


def test_unknown_extension(tmp_path: Path) -> None:
    (tmp_path / "w.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="Unknown checkpoint extension"):
        load_checkpoint(tmp_path / "w.npz")
    with pytest.raises(InputError, match="path"):
        load_checkpoint(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_corrupt_files(tmp_path: Path, damage: str, suffix: str) -> None:
    good = tmp_path / f"good{suffix}"
    if suffix == ".pt":
        torch.save(_sd(), good)
    else:
        save_file(_sd(), good)
    raw = good.read_bytes()
    data = {"truncate": raw[: len(raw) // 2], "garbage": b"not a checkpoint at all", "empty": b""}[damage]
    bad = tmp_path / f"bad{suffix}"
    bad.write_bytes(data)
    with pytest.raises(CheckpointError, match="corrupt") as err:
        load_checkpoint(bad)
    assert str(bad) in str(err.value)


def test_extract_errors_list_top_level_keys() -> None:
    obj = {"epoch": 3, "optimizer": {"state": {}}, "weights": [torch.ones(1)]}
    with pytest.raises(CheckpointError, match=r"'epoch' \(int\).*'optimizer' \(dict.*'weights' \(list\)"):
        extract_state_dict(obj)
    with pytest.raises(CheckpointError, match="prefer='ema'"):
        extract_state_dict({"model": _sd()}, prefer="ema")
    with pytest.raises(CheckpointError, match="got list"):
        extract_state_dict([torch.ones(1)])
    linear = nn.Linear(2, 2)
    _assert_sd_equal(extract_state_dict(linear), linear.state_dict())  # a whole pickled module


# --------------------------------------------------------------------------------------------- key surgery
def test_rename_keys_in_order_and_unused_rules() -> None:
    sd = {"tok_embeddings.weight": 1, "layers.0.attention.wqkv.weight": 2, "output.weight": 3}
    rules = [
        (r"^layers\.(\d+)\.", r"blocks.\1."),
        (r"\.attention\.", ".attn."),
        (r"^blocks\.(\d+)\.attn\.wqkv", lambda m: f"blocks.{m.group(1)}.attn.qkv"),  # sees earlier rewrites
        (r"^norm\.", "final_norm."),  # matches nothing
    ]
    out = rename_keys(sd, rules)
    assert out == {"tok_embeddings.weight": 1, "blocks.0.attn.qkv.weight": 2, "output.weight": 3}
    assert unused_rename_rules(sd, rules) == [rules[3]]
    assert unused_rename_rules(sd.keys(), rules[:3]) == []
    with pytest.raises(CheckpointError, match="maps both"):
        rename_keys({"a.x": 1, "b.x": 2}, [(r"^[ab]\.", "")])
    with pytest.raises(InputError, match="valid regex"):
        rename_keys(sd, [("(", "x")])
    with pytest.raises(InputError, match="pair"):
        rename_keys(sd, [("a",)])  # type: ignore[list-item]


def test_prefix_and_drop_helpers() -> None:
    sd = {"vae.enc.w": 1, "vae.dec.w": 2, "gpt.w": 3}
    assert strip_prefix(sd, "vae.") == {"enc.w": 1, "dec.w": 2, "gpt.w": 3}
    assert strip_prefix(sd, "vae.", keep_unmatched=False) == {"enc.w": 1, "dec.w": 2}
    assert add_prefix({"w": 1}, "model.") == {"model.w": 1}
    assert drop_keys(sd, [r"^vae\.dec\.", r"^gpt"]) == {"vae.enc.w": 1}
    assert drop_keys(sd, r"\.enc\.") == {"vae.dec.w": 2, "gpt.w": 3}
    with pytest.raises(CheckpointError, match="maps both"):
        strip_prefix({"a.w": 1, "w": 2}, "a.")


# ----------------------------------------------------------------------------------------------- load_into
def test_load_into_success() -> None:
    src, dst = Net(), Net()
    report = load_into(dst, src.state_dict())
    assert isinstance(report, LoadReport) and report.loaded == 5 and not report.missing
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v)


def test_load_into_reports_everything_in_one_error() -> None:
    sd = Net(width=3).state_dict()  # fc1.weight is [8, 3] instead of [8, 4]
    del sd["fc2.bias"]
    sd["extra.weight"] = torch.ones(1)
    model = Net()
    before = model.fc2.weight.clone()
    with pytest.raises(CheckpointError) as err:
        load_into(model, sd)
    message = str(err.value)
    assert "Net" in message and "3 problem(s)" in message
    assert "missing from the checkpoint" in message and "fc2.bias" in message
    assert "unexpected in the checkpoint" in message and "extra.weight" in message
    assert "fc1.weight: checkpoint shape [8, 3] vs model shape [8, 4]" in message
    assert "Hint:" in message and "config" in message and "converter" in message
    assert torch.equal(model.fc2.weight, before)  # nothing was loaded


def test_load_into_ignore_patterns_and_non_strict() -> None:
    src = Net()
    sd = {k: v for k, v in src.state_dict().items() if k != "freqs_cis"}
    sd["ema_decay"] = torch.tensor(0.999)
    report = load_into(Net(), sd, ignore_missing=[r"freqs_cis$"], ignore_unexpected=r"^ema_")
    assert report.ignored_missing == ("freqs_cis",) and report.ignored_unexpected == ("ema_decay",)
    assert report.loaded == 4 and "ignored missing 1" in report.summary()

    report = load_into(Net(), sd, strict=False)
    assert report.missing == ("freqs_cis",) and report.unexpected == ("ema_decay",)
    bad = Net(width=3).state_dict()
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_into(Net(), bad, strict=False)
    with pytest.raises(InputError, match="ignore_missing"):
        load_into(Net(), sd, ignore_missing=["("])


def test_load_into_truncates_and_hints_prefix() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(15)])  # 30 keys
    sd = add_prefix(model.state_dict(), "model.")
    with pytest.raises(CheckpointError) as err:
        load_into(model, sd)
    message = str(err.value)
    assert "(30):" in message and "... and 10 more" in message
    assert "strip_prefix(sd, 'model.')" in message


# ------------------------------------------------------------------------------------------------- docs
def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    example = next(b for b in blocks if "unused_rename_rules" in b and "class Tiny" in b)
    exec(compile(example, str(DOCS), "exec"), {"__name__": "docs_example"})
    assert "loaded 3 tensors" in capsys.readouterr().out
