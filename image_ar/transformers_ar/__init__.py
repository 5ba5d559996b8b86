"""transformers' own autoregressive image generators as discrete targets of the shared loop.

- `JanusPipeline`, `Emu3Pipeline` (`pipeline.py`), `LuminaMGPTPipeline` (`lumina_pipeline.py`): text-to-image with
  every discrete method (eagle / lantern with a drafter trained for the model), greedy == the model's own generation.
- `JanusCachedLM` (`janus.py`), `Emu3CachedLM` + `emu3_layout` (`emu3.py`): the models' steps as `mmspec.lm.CachedLM`s.
- `ChameleonCachedLM` + `lumina_layout` (`lumina_mgpt.py`), Chameleon's VQGAN (`chameleon_vqgan.py`) and the
  converter of official Lumina-mGPT folders (`lumina_convert.py`, `mmspec convert lumina-mgpt`).
- `check_image_generator` (`support.py`): what is supported, and the one-line refusal of the rest (other Chameleons).
- `tiny.py`: tiny random models with processors built offline (tests, docs, trying the CLI).

See docs/transformers_image.md.
"""

from mmspec.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {  # name: its module (imported on first use)
    "Emu3Pipeline": "image_ar.transformers_ar.pipeline",
    "JanusPipeline": "image_ar.transformers_ar.pipeline",
    "LuminaMGPTPipeline": "image_ar.transformers_ar.lumina_pipeline",
    "TransformersImagePipeline": "image_ar.transformers_ar.pipeline",
    "check_image_generator": "image_ar.transformers_ar.support",
})
