"""MAR for mmspec: the model with its diffusion head, the KL VAE helpers, vanilla `MARPipeline`, `CSpDPipeline`
(continuous speculative decoding), the world training command, converters, the CLI and bench adapters."""

from mmspec.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {  # name: its module (imported on first use)
    "CSpDPipeline": "continuous.mar.cspd",
    "MARModel": "continuous.mar.model",
    "MARPipeline": "continuous.mar.pipeline",
    "MARPipelineOutput": "continuous.mar.pipeline",
})
