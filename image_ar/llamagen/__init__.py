"""LlamaGen (FoundationVision/LlamaGen): the GPT over VQ image tokens and its official-checkpoint converter.

- `LlamaGenGPT`: the c2i / t2i transformer as a diffusers model (`gpt.py`), a `mmspec.lm.CachedLM`.
- `load_llamagen_gpt`: loads official `c2i_*.pt` / `t2i_*.pt` / FSDP `consolidated.pth` files (`convert_gpt.py`).
- 2D rotary embedding helpers (`rope.py`).
- `LlamaGenVQ`: the VQ image tokenizer (`vq.py`), `load_llamagen_vq` for official `vq_ds*.pt` files.
- `LlamaGenPipeline`: generation with any decoding method (`pipeline.py`; the methods are declared in `family.py`).

See docs/llamagen.md.
"""

from mmspec.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {  # name: its module (imported on first use)
    "infer_llamagen_config": "image_ar.llamagen.convert_gpt",
    "load_llamagen_gpt": "image_ar.llamagen.convert_gpt",
    "convert_llamagen_vq": "image_ar.llamagen.convert_vq",
    "infer_llamagen_vq_config": "image_ar.llamagen.convert_vq",
    "load_llamagen_vq": "image_ar.llamagen.convert_vq",
    "GPT_PRESETS": ("image_ar.llamagen.gpt", "PRESETS"),
    "LlamaGenGPT": "image_ar.llamagen.gpt",
    "LlamaGenGPTOutput": "image_ar.llamagen.gpt",
    "LlamaGenKVCache": "image_ar.llamagen.gpt",
    "ffn_hidden_dim": "image_ar.llamagen.gpt",
    "LlamaGenPipeline": "image_ar.llamagen.pipeline",
    "LlamaGenPipelineOutput": "image_ar.llamagen.pipeline",
    "apply_rope": "image_ar.llamagen.rope",
    "rope_table_2d": "image_ar.llamagen.rope",
    "VQ_PRESETS": ("image_ar.llamagen.vq", "PRESETS"),
    "LlamaGenVQ": "image_ar.llamagen.vq",
    "LlamaGenVQOutput": "image_ar.llamagen.vq",
    "VQLosses": "image_ar.llamagen.vq",
    "VQLossWeights": "image_ar.llamagen.vq_train",
    "vq_loss": "image_ar.llamagen.vq_train",
})
