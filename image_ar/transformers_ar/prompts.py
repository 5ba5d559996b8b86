"""Tokenized prompts of the transformers image generators: right-padded ids and mask (`Prompts`), `right_pad`."""

from __future__ import annotations

from dataclasses import dataclass

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
