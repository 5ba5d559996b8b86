"""VAR (next-scale prediction) for mmspec: the transformer, the residual multi-scale quantiser, the VQVAE and the
vanilla `VARPipeline` so far; converters, world defaults and CoDe collaborative decoding follow (issue 6)."""

from image_ar.var.pipeline import VARPipeline, VARPipelineOutput
from image_ar.var.quantizer import MultiScaleQuantizer
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE

__all__ = ["MultiScaleQuantizer", "VARPipeline", "VARPipelineOutput", "VARTransformer", "VARVQVAE"]
