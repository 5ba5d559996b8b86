"""Tokenized prompts of the transformers image generators: right-padded ids and mask (`Prompts`), `right_pad`, and
`prefill_rows`, the prefill the targets share (their conditional and unconditional rows, each of its own length), and
`guided_prefill`, the prefill of the whole-vocabulary targets (Emu3, Lumina-mGPT) with their unconditional rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmspec.errors import check


def right_pad(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A left- (or right-) padded batch [B, P] -> the same tokens right-padded (real tokens first, in order)."""
    order = torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)  # real tokens first, stable
    return ids.gather(1, order), mask.gather(1, order)


@dataclass
class Prompts:
    """Tokenized prompts: input_ids, attention_mask [B, P], right-padded (1 = real token). A row's generated tokens
    then sit at its own length + i, where transformers' left-padded batch puts them through the mask's cumsum."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        ids, mask = self.input_ids, self.attention_mask
        check(isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point(),
              f"input_ids must be an integer tensor [B, P], got {list(getattr(ids, 'shape', []))}.")
        check(isinstance(mask, torch.Tensor) and mask.shape == ids.shape,
              f"attention_mask must match input_ids {list(ids.shape)}, got {list(getattr(mask, 'shape', []))}.")
        lengths = mask.long().sum(-1)
        check(bool((lengths >= 1).all()), "every prompt needs at least one real token.")
        right = torch.arange(ids.shape[1], device=ids.device) < lengths.unsqueeze(-1)
        check(bool((right == mask.bool()).all()), "prompts must be right-padded (real tokens first).")

    @classmethod
    def from_processor(cls, ids: torch.Tensor, mask: torch.Tensor) -> Prompts:
        """A processor's batch (any padding side) as right-padded Prompts."""
        return cls(*right_pad(ids, mask))

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.long().sum(-1)  # [B]

    def repeat(self, times: int) -> Prompts:
        """Each prompt `times` times in a row (num_images_per_prompt)."""
        return Prompts(self.input_ids.repeat_interleave(times, dim=0),
                       self.attention_mask.repeat_interleave(times, dim=0))


def prefill_rows(model, rows: list[Prompts], extra_capacity: int):
    """`LMTarget`'s prefill of token prompts: `rows` (the prompts, then with CFG the unconditional rows) stacked
    right-padded into R rows, embedded by the model's own input embeddings, run causally over a fresh cache with
    `extra_capacity` more slots, each row's own length committed. `model` is a target with `model` (the transformers
    model), `new_cache`, `forward_embeds` and `device`. Returns (cache, logits for each row's first new token
    [R, 1, V]); the model keeps `prompt_lengths` [R] and `last_hidden` [R, P, H] for feature drafters."""
    width = max(r.input_ids.shape[1] for r in rows)
    ids = torch.cat([torch.nn.functional.pad(r.input_ids, (0, width - r.input_ids.shape[1])) for r in rows])
    ids = ids.to(model.device)  # [R, P] right-padded
    lengths = torch.cat([r.lengths for r in rows]).to(model.device)  # [R]
    model.prompt_lengths = lengths  # feature drafters start from each row's last prompt feature
    cache = model.new_cache(ids.shape[0], width + extra_capacity)
    slots = cache.slots(width)  # [R, P] == positions (right padding)
    logits = model.forward_embeds(model.model.get_input_embeddings()(ids), slots, cache, slots,
                                  cache.attention_mask(slots), head_at=lengths - 1)  # [R, 1, V]
    cache.commit_chain(lengths)
    return cache, logits


def last_tokens(prompts: Prompts) -> Prompts:
    """Each prompt's last real token as a one-token prompt: the unconditional context of transformers' `generate`
    without negative_prompt_ids (Emu3's default without a negative prompt)."""
    last = prompts.input_ids.gather(1, (prompts.lengths - 1).unsqueeze(-1))  # [B, 1]
    return Prompts(last, torch.ones_like(last))


def guided_prefill(guided: bool, negative: Prompts | None = None):
    """`LMTarget`'s prefill for `Prompts`: the prompts and, guided, the unconditional rows (`negative`, one per
    prompt, else each prompt's last token) as the second half of the batch, each row at its own positions and
    length; returns (cache, logits for each row's first generated token [R, 1, V])."""

    def prefill(model: Any, prompts: Prompts, extra_capacity: int):
        check(isinstance(prompts, Prompts), f"the target takes Prompts, got {type(prompts).__name__}.")
        rows = [prompts]
        if guided:
            rows.append(negative if negative is not None else last_tokens(prompts))
        return prefill_rows(model, rows, extra_capacity)

    return prefill
