"""VLM speculative decoding on LLaVA-style targets (EagleVLM, ViSpec, MSD, SpecVLM drafters).

`vlm.target` (a transformers LLaVA as the loop's cached target), `vlm.eagle` (EagleVLM drafter and its EAGLE-2
tree drafter), `vlm.vispec` (ViSpec), `vlm.msd` (MSD), `vlm.specvlm` (SpecVLM), `vlm.pipeline`
(`SpeculativeVLM`: batched generate with streaming), `vlm.world` (the embedded-world LLaVA: config, processor,
prompt format, VQA batches), `vlm.vision_pretrain` and `vlm.train` (`mmspec train vlm`), `vlm.train_drafter`
(`mmspec train vlm-drafter`), `vlm.cli` (`mmspec vlm`) and `vlm.bench` (bench family `vlm`). The embedded world
target ships in assets/vlm with its four drafters in assets/vlm/drafters (docs/vlm.md).
"""
