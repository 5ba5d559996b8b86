"""LlamaGen (FoundationVision/LlamaGen): the GPT over VQ image tokens and its official-checkpoint converter.

- `LlamaGenGPT`: the c2i / t2i transformer as a diffusers model (`gpt.py`), a `mmspec.lm.CachedLM`.
- `load_llamagen_gpt`: loads official `c2i_*.pt` / `t2i_*.pt` / FSDP `consolidated.pth` files (`convert_gpt.py`).
- 2D rotary embedding helpers (`rope.py`).
- `LlamaGenVQ`: the VQ image tokenizer (`vq.py`), `load_llamagen_vq` for official `vq_ds*.pt` files.
- `LlamaGenPipeline`: generation with any decoding method (`pipeline.py`; the methods are declared in `family.py`).

See docs/llamagen.md.
"""

from image_ar.llamagen.convert_gpt import infer_llamagen_config, load_llamagen_gpt
from image_ar.llamagen.convert_vq import convert_llamagen_vq, infer_llamagen_vq_config, load_llamagen_vq
from image_ar.llamagen.gpt import PRESETS as GPT_PRESETS
from image_ar.llamagen.gpt import LlamaGenGPT, LlamaGenGPTOutput, LlamaGenKVCache, ffn_hidden_dim
from image_ar.llamagen.pipeline import LlamaGenPipeline, LlamaGenPipelineOutput
from image_ar.llamagen.rope import apply_rope, rope_table_2d
from image_ar.llamagen.vq import PRESETS as VQ_PRESETS
from image_ar.llamagen.vq import LlamaGenVQ, LlamaGenVQOutput, VQLosses
from image_ar.llamagen.vq_train import VQLossWeights, vq_loss

__all__ = [
    "GPT_PRESETS",
    "VQ_PRESETS",
    "LlamaGenPipeline",
    "LlamaGenPipelineOutput",
    "LlamaGenVQ",
    "LlamaGenVQOutput",
    "VQLossWeights",
    "VQLosses",
    "convert_llamagen_vq",
    "infer_llamagen_vq_config",
    "load_llamagen_vq",
    "vq_loss",
    "LlamaGenGPT",
    "LlamaGenGPTOutput",
    "LlamaGenKVCache",
    "apply_rope",
    "ffn_hidden_dim",
    "infer_llamagen_config",
    "load_llamagen_gpt",
    "rope_table_2d",
]
