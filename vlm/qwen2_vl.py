"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`) as targets.

The model's own modules do all the work (`vlm.target.CachedVLM`: its text model over mmspec's cache); what differs
from LLaVA is where tokens sit in rotary space. Qwen2-VL's M-RoPE gives every token three positions (t, h, w):
text counts on, an image's tokens take (start, start + row, start + col) on its merged grid, and text after it
resumes at start + max(h, w) / merge (transformers' `get_rope_index`, which the prompt goes through). Each row then
has `rope_delta` = its largest position + 1 - its length, and a generated or draft token at loop position c
(cache index + depth) sits at t = h = w = c + rope_delta: one delta per row, kept from the prefill, added to the
loop's positions. The model's own `rope_deltas` state is never used (it would leak from one call into the next).

Inputs are what the model's processor returns, right-padded: input_ids, attention_mask, pixel_values (flattened
patches), and in `VLMInputs.extras` image_grid_thw [N, 3] and mm_token_type_ids [B, P] (0 text, 1 image; built
from the ids when absent). Videos are refused.
"""

from __future__ import annotations

import torch

from mmspec.errors import check
from vlm.target import CachedVLM, Grid, VLMInputs


class Qwen2VLCachedLM(CachedVLM):
    """A Qwen2-VL / Qwen2.5-VL target with M-RoPE positions; see the module docstring."""

    family = "a transformers Qwen2VLForConditionalGeneration or Qwen2_5_VLForConditionalGeneration"

    def __init__(self, model, attention_backend: str | None = None) -> None:
        super().__init__(model, attention_backend)
        self.rope_deltas: torch.Tensor | None = None  # [B, 1] per row, from the last prefill

    @torch.no_grad()
    def image_features(self, inputs: VLMInputs) -> list[torch.Tensor]:
        """Flattened patches + image_grid_thw [N, 3] -> N x [t*h*w / merge^2, H_text] (the model's own)."""
        grid = inputs.extras.get("image_grid_thw")
        check(grid is not None, "Qwen2-VL images need image_grid_thw (from the model's processor) next to "
                                "pixel_values: pass VLMInputs(..., extras={'image_grid_thw': ...}).")
        pixels = inputs.pixel_values.to(self.device)
        out = self.model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid.to(self.device))
        return list(getattr(out, "pooler_output", out))

    def image_grids(self, inputs: VLMInputs, embeds: torch.Tensor) -> list[list[Grid]]:
        """Each image's run is its merged patch grid, row by row: (t * h / merge) x (w / merge) from image_grid_thw."""
        grid = inputs.extras.get("image_grid_thw")
        merge = self.model.config.vision_config.spatial_merge_size
        thw = [] if grid is None else grid.tolist()
        return [[(0, t * h // merge, w // merge, w // merge)] for t, h, w in thw]

    def prompt_positions(self, inputs: VLMInputs, slots: torch.Tensor) -> torch.Tensor:
        """M-RoPE positions [3, B, P] of the right-padded prompts (transformers' `get_rope_index`); keeps each
        row's rope delta for the steps."""
        check("pixel_values_videos" not in inputs.extras, "videos are not supported by mmspec's Qwen2-VL target yet; "
                                                          "give images.")
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        grid = inputs.extras.get("image_grid_thw")
        if grid is None:  # text only: t = h = w = index
            self.rope_deltas = torch.zeros(ids.shape[0], 1, dtype=torch.long, device=self.device)
            return slots.unsqueeze(0).expand(3, *slots.shape)
        types = inputs.extras.get("mm_token_type_ids")
        types = (ids == self.image_token_id).int() if types is None else types.to(self.device)
        positions, deltas = self.model.model.get_rope_index(ids, mm_token_type_ids=types,
                                                            image_grid_thw=grid.to(self.device), attention_mask=mask)
        self.rope_deltas = deltas.to(self.device).view(-1, 1)  # [B, 1]
        return positions  # [3, B, P]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the rope deltas of rows [B'] (the loop dropped the call's finished rows)."""
        if self.rope_deltas is not None:
            self.rope_deltas = self.rope_deltas.index_select(0, rows)

    def step_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Loop positions [B, S] -> [3, B, S]: t = h = w = position + the row's rope delta."""
        check(self.rope_deltas is not None, "run the target's prefill (prefill_vlm) first.")
        shifted = positions.to(self.device) + self.rope_deltas  # [B, S]
        return shifted.unsqueeze(0).expand(3, *shifted.shape)
