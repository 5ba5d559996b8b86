"""VAR (next-scale prediction) for mmspec: the transformer, the residual multi-scale quantiser and the VQVAE so
far; converters, `VARPipeline` and CoDe collaborative decoding follow (issue 6)."""

from image_ar.var.quantizer import MultiScaleQuantizer
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE

__all__ = ["MultiScaleQuantizer", "VARTransformer", "VARVQVAE"]
