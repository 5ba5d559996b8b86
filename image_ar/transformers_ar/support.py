"""Which transformers autoregressive image generators mmspec runs, and the one-line refusal of the others.

- `JanusForConditionalGeneration`: supported (`generate(generation_mode="image")`: generation head, CFG, VQ decoder).
- `ChameleonForConditionalGeneration`: supported as Lumina-mGPT, in the folder `mmspec convert lumina-mgpt` writes
  (its config.json carries `lumina_mgpt`; the pipeline runs transformers' modules without the forward's masking of
  image logits, and Chameleon's VQGAN decoder). Any other Chameleon is refused: transformers' forward sets every
  image-token logit to the minimum and its VQ-VAE has no decoder.
- `Emu3ForConditionalGeneration`: supported (transformers' documented recipe: `generate` with negative-prompt CFG
  and the row layout of its `prefix_allowed_tokens_fn`; its VQ decoder).
See docs/transformers_image.md.
"""

from __future__ import annotations

from mmspec.errors import InputError

SUPPORTED = ("JanusForConditionalGeneration (image generation mode), Emu3ForConditionalGeneration and Lumina-mGPT "
             "(ChameleonForConditionalGeneration in a folder `mmspec convert lumina-mgpt` wrote)")
REFUSED = {
    "chameleon": "transformers' Chameleon forward sets every image-token logit to the minimum and its VQ-VAE has no "
                 "decoder, so transformers itself cannot generate an image with it (for Lumina-mGPT, convert its "
                 "official folder with `mmspec convert lumina-mgpt`)",
}


def check_image_generator(config: dict, where: str) -> str:
    """The model_type of a supported transformers AR image generator (`config` = its config.json as a dict), else an
    InputError in one line that names the supported classes."""
    model_type = config.get("model_type")
    if model_type in ("janus", "emu3"):
        return model_type
    if model_type == "chameleon" and "lumina_mgpt" in config:
        return "lumina-mgpt"
    classes = ", ".join(config.get("architectures") or []) or f"model_type {model_type!r}"
    reason = REFUSED.get(model_type, "it is not a transformers AR image generator mmspec knows")
    raise InputError(f"{where} ({classes}) cannot be a discrete image target: {reason}; mmspec supports {SUPPORTED}.")
