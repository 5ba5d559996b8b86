"""VLM speculative decoding on LLaVA-style targets (EagleVLM, ViSpec, MSD, SpecVLM drafters).

Here so far: `vlm.target` (a transformers LLaVA as the loop's cached target: ragged prefill with images merged,
tree verification, vanilla decoding through `mmspec.loop`), `vlm.world` (the embedded-world LLaVA: config,
processor, prompt format, VQA batches) and `vlm.train` (`mmspec train vlm`). The drafters are not implemented
yet (see docs/vlm.md and the project's issues).
"""
