"""Every model card mmspec ships (and writes) carries Hub-style metadata: library, licence, pipeline tag, tags."""

from pathlib import Path

import pytest

from mmspec.model_card import metadata, strip_metadata, with_metadata

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.mark.parametrize("card", sorted(str(p.relative_to(ASSETS)) for p in ASSETS.rglob("README.md")))
def test_shipped_cards_carry_hub_metadata(card):
    text = (ASSETS / card).read_text()
    fields = metadata(text)
    assert fields["library_name"] == "mmspec" and fields["license"] == "apache-2.0", card
    assert fields["tags"][0] == "mmspec" and "world" in fields["tags"], card
    assert card.startswith("tokenizer") or fields["pipeline_tag"] in (
        "unconditional-image-generation", "text-to-image", "image-text-to-text", "image-classification"), card
    assert strip_metadata(text).startswith("# "), card  # the card itself follows


def test_metadata_is_replaced_not_stacked():
    once = with_metadata("# A card\n", pipeline_tag="image-text-to-text", tags=["llava"])
    twice = with_metadata(once, pipeline_tag="image-classification", tags=["judge"])
    assert twice.count("---\n") == 2 and metadata(twice)["pipeline_tag"] == "image-classification"
    assert strip_metadata(twice) == "# A card\n" and metadata("# no metadata\n") == {}
