"""VAR (next-scale prediction) for mmspec: the transformer, the residual multi-scale quantiser, the VQVAE, the
vanilla `VARPipeline` and CoDe's `CoDePipeline` so far; converters, world defaults, training commands, the CLI and
the benchmarks follow (issue 6)."""

from image_ar.var.code import CoDePipeline
from image_ar.var.pipeline import VARPipeline, VARPipelineOutput
from image_ar.var.quantizer import MultiScaleQuantizer
from image_ar.var.transformer import VARTransformer
from image_ar.var.vqvae import VARVQVAE

__all__ = ["CoDePipeline", "MultiScaleQuantizer", "VARPipeline", "VARPipelineOutput", "VARTransformer", "VARVQVAE"]
