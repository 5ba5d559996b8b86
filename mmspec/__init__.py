"""mmspec: speculative and collaborative decoding for multimodal generation.

The shared core lives here: sampling (`mmspec.sampling`), acceptance rules (`mmspec.verify`), draft trees
(`mmspec.tree`), KV caches (`mmspec.cache`), attention backends and kernels (`mmspec.attention`,
`mmspec.kernels`), the draft-verify-commit loop (`mmspec.loop`), statistics (`mmspec.stats`) and safe
checkpoint loading (`mmspec.checkpoints`). Pipelines live in the sibling packages `vlm`, `image_ar` and
`continuous`.
"""

__version__ = "0.1.0"
