"""transformers' own autoregressive image generators as discrete targets of the shared loop.

- `JanusPipeline`, `Emu3Pipeline` (`pipeline.py`): text-to-image with any discrete method that needs no trained
  drafter (vanilla, sjd, gsd), greedy == the model's own generation.
- `JanusCachedLM` (`janus.py`), `Emu3CachedLM` + `emu3_layout` (`emu3.py`): the models' steps as `mmspec.lm.CachedLM`s.
- `check_image_generator` (`support.py`): what is supported, and the one-line refusal of the rest (Chameleon).
- `tiny.py`: tiny random models with processors built offline (tests, docs, trying the CLI).

See docs/transformers_image.md.
"""

from mmspec.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {  # name: its module (imported on first use)
    "Emu3Pipeline": "image_ar.transformers_ar.pipeline",
    "JanusPipeline": "image_ar.transformers_ar.pipeline",
    "TransformersImagePipeline": "image_ar.transformers_ar.pipeline",
    "check_image_generator": "image_ar.transformers_ar.support",
})
