"""Teacher-forced target distributions for finished LlamaGen token sequences.

    p = target_probs(pipe, [0, 3], out.tokens, guidance_scale=4.0, top_k=64)  # [N, T, V]; t2i: captions

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


def target_probs(pipe: LlamaGenPipeline, conditions: list[int] | list[str] | torch.Tensor, tokens: torch.Tensor,
                 guidance_scale: float | None = None, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distributions [N, T, V] at every position of `tokens` [N, T] (T <= block_size), for
    class labels (c2i models) or captions (t2i models, encoded as `pipe(prompt)` encodes them); guidance_scale None =
    the pipeline's default, as a call."""
    model = pipe.transformer
    guidance_scale = pipe.default_guidance_scale() if guidance_scale is None else guidance_scale
    check(tokens.dim() == 2 and 1 <= tokens.shape[1] <= model.config.block_size,
          f"tokens must be [N, T] with 1 <= T <= block_size ({model.config.block_size}); got {tuple(tokens.shape)}.")
    params = SamplingParams(temperature, top_k, top_p)
    mask = None
    if model.config.model_type == "t2i":
        cond, mask = pipe.encode_prompt(list(conditions))  # [N, L, D], [N, L]
    else:
        cond = class_labels_tensor(conditions, 1, model.config.num_classes, model.device)  # [N]
    check(cond.shape[0] == tokens.shape[0], f"{cond.shape[0]} conditions for {tokens.shape[0]} token rows.")
    guided = guidance_scale != 1.0
    runner = GuidedRunner(model, guidance_scale if guided else None, condition_prefill(guided, mask))
    return teacher_forced_probs(runner, cond, tokens.to(model.device), params)  # [N, T, V]
