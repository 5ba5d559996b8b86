"""LlamaGen at its official sizes with random weights (`image_ar.llamagen.official`): the configurations (built on
the meta device: no memory, no time) and the bench options that select them."""

import pytest
import torch

from image_ar.llamagen.bench import _options
from image_ar.llamagen.official import random_pipeline
from mmspec.bench.registry import BenchSettings
from mmspec.errors import InputError


def millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


@pytest.mark.parametrize("size, params", [("B", 111), ("L", 343), ("XL", 775), ("XXL", 1411), ("3B", 3097)])
def test_official_sizes_have_the_published_parameter_counts(size, params):
    pipe = random_pipeline(size, device="meta", dtype=torch.bfloat16, draft_size=None)
    assert round(millions(pipe.transformer)) == params  # LlamaGen's README: 111M, 343M, 775M, 1.4B, 3.1B
    assert pipe.transformer.config.vocab_size == 16384 and pipe.transformer.config.block_size == 256
    assert pipe.eagle_drafter.config.dim == pipe.transformer.config.dim and pipe.eagle_drafter.config.n_layer == 1
    assert {p.dtype for p in pipe.components["transformer"].parameters()} == {torch.bfloat16}
    assert pipe.vqvae.config.codebook_size == 16384 and pipe.vqvae.config.codebook_embed_dim == 8


def test_logit_scale_widens_the_output_head():
    torch.manual_seed(0)
    plain = random_pipeline("B", device="meta").transformer.output.weight
    assert plain.shape == (16384, 768)
    heads = [random_pipeline("B", logit_scale=s, draft_size=None).transformer.output.weight.detach().std()
             for s in (1, 40)]
    assert float(heads[1] / heads[0]) == pytest.approx(40, rel=0.01)
    with pytest.raises(InputError, match="logit_scale"):
        random_pipeline("B", device="meta", logit_scale=0)


def test_the_draft_model_is_a_smaller_official_size_and_384_px_has_576_tokens():
    pipe = random_pipeline("XL", device="meta", draft_size="B", image_size=384)
    assert pipe.draft_transformer.config.dim == 768 and pipe.transformer.config.block_size == 576
    assert random_pipeline("B", device="meta").draft_transformer is None  # no smaller size to draft with
    with pytest.raises(InputError, match="image_size"):
        random_pipeline("B", device="meta", image_size=512)
    with pytest.raises(InputError, match="known presets"):
        random_pipeline("XXXXL", device="meta")


@pytest.mark.parametrize("options, says", [
    ({"size": "XL", "model": "somewhere"}, "cannot go with model"),
    ({"draft_size": "B"}, "give size="),
    ({"decode": "maybe"}, "true or false"),
    ({"size": "B", "logit_scale": "big"}, "positive number"),
    ({"logit_scale": "40"}, "give size="),
    ({"dtype": "float64"}, "dtype must be"),
])
def test_bad_official_size_options_are_one_line_errors(options, says):
    from image_ar.llamagen.bench import build

    with pytest.raises(InputError, match=says):
        _options(BenchSettings(options=options)) if "dtype" not in options else build(
            BenchSettings(options={**options, "size": "B"}, device="meta"))
