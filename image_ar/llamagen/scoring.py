"""Teacher-forced target distributions for finished LlamaGen token sequences.

    p = target_probs(pipe, class_labels=[0, 3], tokens=out.tokens, guidance_scale=4.0, top_k=64)  # [N, T, V]

p[:, t] is the distribution vanilla decoding would sample token t from given tokens[:, :t] (the same condition,
CFG, temperature and top-k/p filters; `mmspec.lm.teacher_forced_probs`). `mmspec.metrics.calibration` uses it
to measure how closely a decoding method's tokens follow the target (the bench's `pit_ks` figures).
"""

from __future__ import annotations

import torch

from image_ar.llamagen.pipeline import LlamaGenPipeline, condition_prefill
from mmspec.errors import check
from mmspec.lm import GuidedRunner, teacher_forced_probs
from mmspec.pipeline_io import class_labels_tensor
from mmspec.sampling import SamplingParams


def target_probs(pipe: LlamaGenPipeline, class_labels: list[int] | torch.Tensor, tokens: torch.Tensor,
                 guidance_scale: float = 4.0, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distributions [N, T, V] at every position of `tokens` [N, T] (class-conditional
    models; T <= block_size)."""
    model = pipe.transformer
    check(model.config.model_type == "c2i", "target_probs scores class-conditional (c2i) LlamaGen models.")
    check(tokens.dim() == 2 and 1 <= tokens.shape[1] <= model.config.block_size,
          f"tokens must be [N, T] with 1 <= T <= block_size ({model.config.block_size}); got {tuple(tokens.shape)}.")
    params = SamplingParams(temperature, top_k, top_p)
    cond = class_labels_tensor(class_labels, 1, model.config.num_classes, model.device)  # [N]
    check(cond.shape[0] == tokens.shape[0], f"{cond.shape[0]} class labels for {tokens.shape[0]} token rows.")
    guided = guidance_scale != 1.0
    runner = GuidedRunner(model, guidance_scale if guided else None, condition_prefill(guided))
    return teacher_forced_probs(runner, cond, tokens.to(model.device), params)  # [N, T, V]
