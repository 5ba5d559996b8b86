"""VAR (next-scale prediction) for mmspec: the transformer so far; the multi-scale VQVAE, converters,
`VARPipeline` and CoDe collaborative decoding follow (issue 6)."""

from image_ar.var.transformer import VARTransformer

__all__ = ["VARTransformer"]
