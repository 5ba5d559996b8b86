"""Official VAR transformer checkpoints: a synthetic `var_d*.pth` with the official layout (raw state dict with the
official buffers) converts into a VARTransformer computing the same logits; inference and errors."""

import pytest
import torch

from image_ar.var import VARTransformer
from image_ar.var.convert import infer_var_config, load_var_transformer
from mmspec.errors import CheckpointError, InputError


def official_file(tmp_path, **kwargs):
    torch.manual_seed(0)
    config = dict(vocab_size=32, cvae=4, num_classes=5, depth=2, embed_dim=16, num_heads=2, patch_nums=(1, 2, 3))
    model = VARTransformer(**{**config, **kwargs}).eval()
    sd = dict(model.state_dict())
    levels = model.levels.view(1, -1, 1)  # the official buffers, which the converter must drop
    sd["attn_bias_for_masking"] = torch.where(levels >= levels.transpose(1, 2), 0.0, -torch.inf).view(1, 1, 14, 14)
    sd["lvl_1L"] = model.levels.view(1, -1)
    for i in range(model.depth):
        sd[f"blocks.{i}.attn.zero_k_bias"] = torch.zeros(16)
    path = tmp_path / "var_d2.pth"
    torch.save(sd, path)
    return model, path


@pytest.mark.parametrize("kwargs", [{}, {"shared_aln": True}, {"attn_l2_norm": False, "num_heads": 2}])
def test_converted_model_computes_the_same_logits(tmp_path, kwargs):
    model, path = official_file(tmp_path, **kwargs)
    converted = load_var_transformer(path, patch_nums=(1, 2, 3))
    labels, feats = torch.tensor([0, 4]), torch.randn(2, 13, 4)
    with torch.no_grad():
        torch.testing.assert_close(converted(labels, feats), model(labels, feats))
    assert converted.config.shared_aln == kwargs.get("shared_aln", False)


def test_config_inference_reads_sizes_and_needs_the_schedule_for_non_official_files(tmp_path):
    _, path = official_file(tmp_path)
    sd = torch.load(path, weights_only=True)
    with pytest.raises(InputError, match="patch_nums"):
        infer_var_config(sd)
    cfg = infer_var_config(sd, patch_nums=(1, 2, 3))
    sizes = (cfg["depth"], cfg["embed_dim"], cfg["num_heads"], cfg["num_classes"], cfg["mlp_ratio"])
    assert sizes == (2, 16, 2, 5, 4.0)
    with pytest.raises(InputError, match="positions"):
        infer_var_config(sd, patch_nums=(1, 2))


def test_a_file_of_another_family_is_a_clear_error(tmp_path):
    path = tmp_path / "other.pth"
    torch.save({"tok_embeddings.weight": torch.zeros(4, 4)}, path)
    with pytest.raises(CheckpointError, match="not a VAR transformer"):
        load_var_transformer(path)
