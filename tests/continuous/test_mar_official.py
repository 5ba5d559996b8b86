"""MAR at its official sizes (random weights): the published parameter counts, CSpD's pair, and the bench options
that build them (`continuous.mar.official`)."""

from __future__ import annotations

import pytest
import torch

from continuous.mar.cspd import CSpDPipeline
from continuous.mar.official import official_mar, parse_size, random_pipeline
from continuous.mar.pipeline import MARPipeline
from mmspec.bench.registry import BenchSettings
from mmspec.errors import InputError

PUBLISHED = {"B": 208e6, "L": 479e6, "H": 943e6}  # the MAR paper's table (arXiv 2406.11838)


@pytest.mark.parametrize("size", ["B", "L", "H"])
def test_parameter_counts_are_the_papers(size):
    with torch.device("meta"):
        model = official_mar(size)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / PUBLISHED[size] - 1) < 0.005, count
    assert model.seq_len == 256 and model.token_channels == 16 and model.config.num_classes == 1000


def test_cspd_pair_and_a_target_alone():
    pair = random_pipeline("mar-l", "base", device="meta", dtype=torch.bfloat16)
    assert isinstance(pair, CSpDPipeline)
    assert pair.target.config.embed_dim == 1024 and pair.draft.config.embed_dim == 768
    assert pair.target.dtype == torch.bfloat16 and pair.vae.config.latent_channels == 16
    alone = random_pipeline("B", draft_size="B", device="meta")
    assert isinstance(alone, MARPipeline) and alone.transformer.config.embed_dim == 768
    with pytest.raises(InputError, match="unknown MAR size 'XL'; official sizes: B, L, H"):
        parse_size("XL")


def test_bench_options():
    from continuous.mar.bench import _options, model_id

    def settings(**options):
        return BenchSettings(options=options)

    assert model_id(settings(size="L")) == "MAR-L + MAR-B draft (random weights)"
    with pytest.raises(InputError, match="draft_size applies to an official size"):
        _options(settings(draft_size="B"))
    with pytest.raises(InputError, match="cannot go with model=PATH"):
        _options(settings(size="B", model="assets/mar"))
    with pytest.raises(InputError, match="decode must be true or false"):
        _options(settings(decode="no"))
