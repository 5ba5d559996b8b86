"""Hub-style metadata of the model cards mmspec writes: every training command prepends a YAML front matter
(library, licence, pipeline tag, tags) to the README.md of the folder it makes, so the folders are ready to publish.

    text = with_metadata(card_text, pipeline_tag="image-text-to-text", tags=["llava", "world"])
    metadata(text)                 # the parsed front matter (dict), {} without one
"""

from __future__ import annotations

from collections.abc import Sequence

import yaml

LICENSE = "apache-2.0"  # the project's (pyproject.toml); the embedded models are trained here, on its world


def strip_metadata(text: str) -> str:
    """The card without its YAML front matter (unchanged when it has none)."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end >= 0:
            return text[end + 5:].lstrip("\n")
    return text


def metadata(text: str) -> dict:
    """The card's YAML front matter as a dict ({} without one)."""
    if not text.startswith("---\n") or text.find("\n---\n", 4) < 0:
        return {}
    return yaml.safe_load(text[4: text.find("\n---\n", 4)]) or {}


def with_metadata(text: str, *, pipeline_tag: str | None, tags: Sequence[str] = ()) -> str:
    """`text` with a front matter: library mmspec, the licence, `pipeline_tag` (a Hub task; None for a tokenizer)
    and tags (mmspec's first); an existing front matter is replaced."""
    fields: dict = {"library_name": "mmspec", "license": LICENSE}
    if pipeline_tag is not None:
        fields["pipeline_tag"] = pipeline_tag
    fields["tags"] = ["mmspec", *tags]
    return "---\n" + yaml.safe_dump(fields, sort_keys=False) + "---\n\n" + strip_metadata(text)
