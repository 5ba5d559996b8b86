"""Tiny LLaVA models and right-padded prompt batches for the VLM tests (built from configs, never downloaded)."""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from vlm.target import VLMInputs

IMAGE_TOKEN, IMAGE_SEQ, VOCAB = 4, 16, 99


def tiny_llava(strategy: str = "default", seed: int = 0) -> LlavaForConditionalGeneration:
    torch.manual_seed(seed)
    patches = 17 if strategy == "full" else 16
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=2),
        text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
        image_token_index=IMAGE_TOKEN, image_seq_length=patches, vision_feature_select_strategy=strategy,
        vision_feature_layer=-2)
    return LlavaForConditionalGeneration(cfg).eval()


def prompt(text_before: list[int], text_after: list[int], n_image: int) -> list[int]:
    return [1] + text_before + [IMAGE_TOKEN] * n_image + text_after


def batch(rows: list[list[int]], pixel_values: torch.Tensor) -> VLMInputs:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return VLMInputs(ids, mask, pixel_values)


def greedy_vanilla_and_tree(lm, tree_cls, drafter, rows: list[list[int]], pixels: torch.Tensor, steps: int = 12):
    """Greedy vanilla decoding and greedy EAGLE-2 tree drafting (top_k 3, depth 3, 8 nodes) with `tree_cls` over
    the same right-padded batch: (vanilla output, speculative output)."""
    from mmspec.lm import LMTarget, NoDrafter
    from mmspec.loop import generate
    from mmspec.sampling import SamplingParams
    from vlm.target import prefill_vlm

    params, b = SamplingParams(temperature=0.0), len(rows)
    vanilla = generate(LMTarget(lm, params, steps, prefill_fn=prefill_vlm), NoDrafter(), "greedy",
                       batch(rows, pixels), batch_size=b, max_new_tokens=steps)
    tree = tree_cls(drafter, lm, params, top_k=3, depth=3, total_tokens=8)
    spec = generate(LMTarget(lm, params, steps, max_draft_nodes=8, prefill_fn=prefill_vlm), tree, "lossless",
                    batch(rows, pixels), batch_size=b, max_new_tokens=steps)
    return vanilla, spec
