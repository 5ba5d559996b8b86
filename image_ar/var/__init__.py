"""VAR (next-scale prediction) for mmspec: the transformer and the residual multi-scale quantiser so far; the
VQVAE encoder/decoder, converters, `VARPipeline` and CoDe collaborative decoding follow (issue 6)."""

from image_ar.var.quantizer import MultiScaleQuantizer
from image_ar.var.transformer import VARTransformer

__all__ = ["MultiScaleQuantizer", "VARTransformer"]
