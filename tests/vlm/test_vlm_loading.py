"""`SpeculativeVLM.from_pretrained` loads as transformers loads: a hub id through the local Hugging Face cache
(never a download; one line when it is not there), dtype / torch_dtype, device_map; `.to()`; drafter folders save,
reload and load by hub id too."""

from __future__ import annotations

import pytest
import torch

from mmspec.errors import InputError
from vlm.family import drafter_model
from vlm.pipeline import SpeculativeVLM, load_drafter
from vlm.tiny import tiny_processor_batch, tiny_vlm


def into_hub_cache(home, repo: str, save) -> None:
    """Write a model into a Hugging Face cache layout under `home` (HF_HOME): hub/models--owner--name/snapshots/<sha>
    with refs/main naming it, as `hf download` leaves it."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / sha
    snapshot.mkdir(parents=True)
    save(snapshot)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)


@pytest.fixture(scope="module")
def tiny():
    vlm = tiny_vlm("llava")
    drafter = drafter_model("eagle").for_target(vlm.lm).eval()
    return vlm, drafter


def saved_target(vlm, drafter):
    def save(folder):
        vlm.model.save_pretrained(folder)
        vlm.processor.save_pretrained(folder)
        drafter.save_pretrained(folder / "drafters" / "eagle")
    return save


def test_a_hub_id_loads_from_the_local_cache(tiny, tmp_path, monkeypatch):
    vlm, drafter = tiny
    into_hub_cache(tmp_path, "acme/tiny-llava", saved_target(vlm, drafter))
    into_hub_cache(tmp_path, "acme/tiny-llava-eagle", drafter.save_pretrained)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    enc = tiny_processor_batch(vlm, n=2)
    reference = vlm.model.generate(**enc, max_new_tokens=6, do_sample=False)
    loaded = SpeculativeVLM.from_pretrained("acme/tiny-llava", drafter="eagle")
    assert torch.equal(loaded.generate(**enc, max_new_tokens=6, do_sample=False, budget="fixed"), reference)
    assert loaded.last_stats.num_drafts > 0
    by_id = SpeculativeVLM.from_pretrained("acme/tiny-llava@main", drafter="eagle",
                                           drafter_path="acme/tiny-llava-eagle")
    for ours, theirs in zip(by_id.drafter.state_dict().values(), drafter.state_dict().values()):
        assert torch.equal(ours, theirs)
    with pytest.raises(InputError, match=f"'acme/absent' is neither a folder nor in the local Hugging Face cache "
                                         f"\\({tmp_path}/hub\\).*never downloads") as err:
        SpeculativeVLM.from_pretrained("acme/absent")
    assert "\n" not in str(err.value)


def test_dtype_device_map_and_to(tiny, tmp_path):
    vlm, drafter = tiny
    saved_target(vlm, drafter)(tmp_path)
    loaded = SpeculativeVLM.from_pretrained(tmp_path, drafter="eagle", dtype=torch.bfloat16, device_map="cpu")
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.drafter.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}
    auto = SpeculativeVLM.from_pretrained(tmp_path, device_map="auto")  # (this machine: the CPU)
    assert {p.device.type for p in auto.model.parameters()} == {"cpu"}
    enc = tiny_processor_batch(vlm, n=2)
    assert loaded.generate(**enc, max_new_tokens=4, do_sample=False).shape[1] == enc["input_ids"].shape[1] + 4
    older = SpeculativeVLM.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert older.model.lm_head.weight.dtype == torch.bfloat16
    assert loaded.to(torch.float32) is loaded and loaded.model.lm_head.weight.dtype == torch.float32
    assert {p.dtype for p in loaded.drafter.parameters()} == {torch.float32}
    loaded.to("cpu", dtype=torch.float32)
    reference = vlm.model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(**enc, max_new_tokens=6, do_sample=False), reference)
    with pytest.raises(InputError, match="device or device_map, not both"):
        SpeculativeVLM.from_pretrained(tmp_path, device="cpu", device_map="cpu")


@pytest.mark.parametrize("kind", ["eagle", "vispec", "msd", "specvlm"])
def test_a_drafter_folder_saves_and_reloads(tiny, tmp_path, kind):
    vlm, _ = tiny
    drafter = drafter_model(kind).for_target(vlm.lm).eval()
    drafter.save_pretrained(tmp_path / kind)
    again = load_drafter(tmp_path / kind, kind)
    assert type(again) is type(drafter)
    saved, loaded = drafter.state_dict(), again.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
