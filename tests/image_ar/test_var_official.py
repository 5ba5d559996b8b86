"""VAR at its official sizes with random weights (`image_ar.var.official`): the configurations, built on the meta
device (no memory, no time), and the bench options that select them."""

import pytest
import torch

from image_ar.var.bench import _options
from image_ar.var.code import CoDePipeline
from image_ar.var.official import parse_size, random_pipeline
from image_ar.var.pipeline import VARPipeline
from mmspec.bench.registry import BenchSettings
from mmspec.errors import InputError


@pytest.mark.parametrize("depth, millions", [(16, 310), (20, 601), (24, 1033), (30, 2010)])
def test_official_sizes_have_the_published_parameter_counts(depth, millions):
    pipe = random_pipeline(depth, None, device="meta", dtype=torch.bfloat16)  # VAR's README: 310M, 600M, 1.0B, 2.0B
    assert isinstance(pipe, VARPipeline)
    model = pipe.transformer
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == millions
    assert model.embed_dim == 64 * depth and model.num_heads == depth and model.num_tokens == 680
    assert model.head.weight.dtype == torch.float32 and model.word_embed.weight.dtype == torch.bfloat16


def test_code_pairs_the_large_size_with_a_smaller_one():
    pipe = random_pipeline("d30", "d16", device="meta")
    assert isinstance(pipe, CoDePipeline) and pipe.drafter.depth == 30 and pipe.refiner.depth == 16
    assert isinstance(random_pipeline("d16", "d16", device="meta"), VARPipeline)  # nothing smaller to refine with
    assert parse_size("VAR-d24") == 24
    with pytest.raises(InputError, match="official sizes: d16, d20, d24, d30"):
        parse_size("d12")


@pytest.mark.parametrize("options, says", [
    ({"size": "d30", "model": "somewhere"}, "cannot go with model"),
    ({"small_size": "d16"}, "give size="),
    ({"decode": "no"}, "true or false"),
])
def test_bad_official_size_options_are_one_line_errors(options, says):
    with pytest.raises(InputError, match=says):
        _options(BenchSettings(options=options))
