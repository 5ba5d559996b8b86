"""VAR (next-scale prediction) for mmspec: the transformer, the residual multi-scale quantiser, the VQVAE, the
vanilla `VARPipeline` and CoDe's collaborative `CoDePipeline` (the family record, converters and training commands
are in this package's other modules; see docs/var.md)."""

from mmspec.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {  # name: its module (imported on first use)
    "CoDePipeline": "image_ar.var.code",
    "VARPipeline": "image_ar.var.pipeline",
    "VARPipelineOutput": "image_ar.var.pipeline",
    "MultiScaleQuantizer": "image_ar.var.quantizer",
    "VARTransformer": "image_ar.var.transformer",
    "VARVQVAE": "image_ar.var.vqvae",
})
