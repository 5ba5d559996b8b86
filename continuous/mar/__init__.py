"""MAR for mmspec: the model with its diffusion head, the KL VAE helpers, vanilla `MARPipeline`, `CSpDPipeline`
(continuous speculative decoding), the world training command, converters, the CLI and bench adapters."""

from continuous.mar.cspd import CSpDPipeline
from continuous.mar.model import MARModel
from continuous.mar.pipeline import MARPipeline, MARPipelineOutput

__all__ = ["CSpDPipeline", "MARModel", "MARPipeline", "MARPipelineOutput"]
