"""transformers' `generate` conventions for `SpeculativeVLM.generate(**processor_outputs, ...)`.

    enc = processor(images=images, text=texts, padding=True, return_tensors="pt")
    out = vlm.generate(**enc, max_new_tokens=64, do_sample=False)             # [B, P + N], like model.generate
    vlm.generate(**enc, generation_config=GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9))
    vlm.generate(**enc, streamer=TextIteratorStreamer(processor.tokenizer, skip_prompt=True))  # batch 1

- Sampling settings: the explicit arguments, else `generation_config`, else the model's own `generation_config`
  (transformers' precedence). do_sample False = greedy (temperature, top_p, top_k ignored, as in transformers);
  otherwise temperature, top_k (transformers' default 50) and top_p as the config says.
- Stop ids: the config's eos_token_id (one id or a list); new tokens: max_new_tokens (else max_length - P).
- Padding: the processor's rows may be left- or right-padded; the loop runs them right-padded (`right_padded`),
  and the result is the input ids as given followed by the new tokens, rows that stopped early padded with
  pad_token_id: the tensor transformers returns.
- Speculation settings in vLLM's names: `num_speculative_tokens=K` drafts a chain of K tokens per step (the
  drafter's tree with depth K, top_k 1, K + 1 nodes); `method` names the drafter kind (checked against the loaded
  one). `return_dict_in_generate=True` returns `SpeculativeGenerateOutput(sequences, metrics)` with
  `mmspec.stats.SpecStats.to_dict()` (vLLM's metric names).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from mmspec.errors import check
from mmspec.sampling import SamplingParams
from vlm.target import VLMInputs

PER_TOKEN_INPUTS = ("mm_token_type_ids", "token_type_ids")  # [B, P] inputs that move with the tokens
# what transformers uses for a generation setting left unset (None) by the user and the model's config
UNSET_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "max_length": 20}


def setting(config, name: str):
    """`config`'s value of `name`, or transformers' default when it is unset."""
    value = getattr(config, name, None)
    return UNSET_DEFAULTS[name] if value is None else value


@dataclass
class SpeculativeGenerateOutput:
    """`generate(..., return_dict_in_generate=True)`: sequences [B, P + N] and vLLM-named metrics."""

    sequences: torch.Tensor
    metrics: dict = field(default_factory=dict)


def resolve_generation(model, generation_config, overrides: dict) -> tuple[SamplingParams, int | None, object]:
    """(sampling params, max_new_tokens or None, eos ids) from explicit `overrides` (None = not given), then
    `generation_config`, then the model's own generation config."""
    from transformers import GenerationConfig

    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    check(isinstance(config, GenerationConfig), f"generation_config must be a transformers GenerationConfig, got "
                                                f"{type(generation_config).__name__}.")
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    check(getattr(config, "num_beams", None) in (None, 1), "beam search is not speculative decoding; use num_beams=1.")
    if not setting(config, "do_sample"):
        params = SamplingParams(temperature=0.0)
    else:
        params = SamplingParams(temperature=float(setting(config, "temperature")), top_k=int(setting(config, "top_k")),
                                top_p=float(setting(config, "top_p")))
    return params, config.max_new_tokens, config.eos_token_id


def right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pixel_values, extras: dict
                 ) -> VLMInputs:
    """VLMInputs with every row's real tokens first (input rows may be left- or right-padded; per-token extras
    such as mm_token_type_ids move with their tokens)."""
    check(isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2,
          f"input_ids must be a [B, P] tensor (the processor's output), got {type(input_ids).__name__}.")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()
    check(mask.shape == input_ids.shape, f"attention_mask {list(mask.shape)} must match input_ids "
                                         f"{list(input_ids.shape)}.")
    order = torch.sort(1 - mask, dim=-1, stable=True).indices  # [B, P] real tokens first, in order
    moved = {k: (v.gather(1, order.to(v.device)) if k in PER_TOKEN_INPUTS else v) for k, v in extras.items()}
    return VLMInputs(input_ids.gather(1, order), mask.gather(1, order), pixel_values, moved)


def sequences_tensor(input_ids: torch.Tensor, token_ids: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """transformers' output: input ids as given, then each row's new tokens padded with pad_token_id."""
    width = max((len(row) for row in token_ids), default=0)
    new = torch.full((len(token_ids), width), pad_token_id, dtype=input_ids.dtype)
    for row, ids in enumerate(token_ids):
        new[row, : len(ids)] = torch.tensor(ids, dtype=input_ids.dtype)
    return torch.cat([input_ids.cpu(), new], dim=1)


class StreamerBridge:
    """Feeds a transformers streamer (`put(ids)`, `end()`) from `SpeculativeVLM`'s per-round stream callback:
    the prompt first (streamers skip it with skip_prompt=True), then each round's committed tokens."""

    def __init__(self, streamer, prompt_ids: torch.Tensor) -> None:
        self.streamer = streamer
        streamer.put(prompt_ids.cpu())

    def __call__(self, row: int, text: str, token_ids: list[int]) -> None:
        self.streamer.put(torch.tensor([token_ids]))

    def end(self) -> None:
        self.streamer.end()
