"""VLM speculative decoding on LLaVA-style targets (EagleVLM, ViSpec, MSD, SpecVLM drafters).

Not implemented yet: see the project's issues. The shared machinery these pipelines use lives in `mmspec`.
"""
