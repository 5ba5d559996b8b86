"""Every family runs in float32, bfloat16 and float16 on the CPU (issue 29): the embedded pipelines loaded in the
dtype through the families' loaders (what `mmspec generate --dtype` and `mmspec vlm --dtype` use), a speculative
method each, finite images / answers; the weights really are in the dtype (VAR's head stays float32 when loaded,
as the official code runs it)."""

from __future__ import annotations

import pytest
import torch

from mmspec.families import get_family

DTYPES = [torch.bfloat16, torch.float16]
# MAR runs one row: its float16 / bfloat16 linears on this CPU take ~15 s a row (one test thread)
IMAGE_RUNS = {"llamagen": {"method": "sjd", "class_labels": [1, 3]}, "var": {"class_labels": [1, 3]},
              "mar": {"gamma": 4, "num_sampling_steps": 5, "class_labels": [3]}}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", sorted(IMAGE_RUNS))
def test_image_families_run_in_low_precision(family, dtype):
    pipe = get_family(family).load(None, "cpu", dtype)
    model = {"llamagen": "transformer", "var": "refiner", "mar": "target"}[family]
    assert getattr(pipe, model).dtype == dtype
    if family == "var":
        assert pipe.refiner.head.weight.dtype == torch.float32  # _keep_in_fp32_modules
    out = pipe(generator=torch.Generator().manual_seed(0), output_type="pt", **IMAGE_RUNS[family])
    images = out.images.float()
    assert images.shape[0] == len(IMAGE_RUNS[family]["class_labels"])
    assert torch.isfinite(images).all() and 0 <= images.min() and images.max() <= 1
    assert images.std() > 0.01  # not a blank image


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vlm_runs_in_low_precision(dtype):
    from vlm.pipeline import SpeculativeVLM
    from vlm.world import world_vqa_examples

    vlm = SpeculativeVLM.from_pretrained(get_family("vlm").default_model, "eagle", dtype=dtype)
    assert vlm.model.dtype == dtype and vlm.drafter.dtype == dtype
    examples = world_vqa_examples("test", 2, seed=0, long_fraction=1.0)
    out = vlm.generate([ex.image for ex in examples], [ex.prompt for ex in examples], max_new_tokens=16)
    assert all(len(ids) > 0 for ids in out.token_ids) and out.stats.num_drafts > 0
    assert any(ex.qa.short in text for ex, text in zip(examples, out.texts))  # still answers sensibly


def test_generate_command_takes_dtype(tmp_path, capsys):
    from mmspec.cli import main

    out = tmp_path / "var"
    assert main(["generate", "--family", "var", "--method", "code", "--classes", "0", "--num-images", "1",
                 "--dtype", "bfloat16", "--out", str(out), "--quiet"]) == 0
    assert len(list((out / "images").glob("*.png"))) == 1
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["generate", "--family", "var", "--dtype", "float64", "--out", str(tmp_path / "x")])
    assert "invalid choice" in capsys.readouterr().err
