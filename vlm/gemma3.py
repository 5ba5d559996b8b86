"""Gemma 3 (`Gemma3ForConditionalGeneration`) as the loop's cached target: images attend bidirectionally inside.

Gemma 3 differs from LLaVA-1.5 in one place that changes the answer: while the prompt is prefilled, the tokens of
one image attend to each other in both directions (the model's `create_masks_for_generate` ORs a block mask,
built from token_type_ids, onto the causal mask of every layer, sliding or global); everything after the prompt
(generated tokens, draft chains and trees) is causal. `Gemma3CachedLM.prompt_mask` ORs the same blocks onto
mmspec's prefill mask: a query at an image token also sees every token of its own image run.

    same[b, i, j] = image_run[b, i] >= 0 and image_run[b, i] == image_run[b, j]     # [B, P, P]

Everything else is `vlm.target.CachedVLM`: image features from the model's own `get_image_features` (SigLIP,
pooled to `mm_tokens_per_image` tokens, projected), the text model's own forward (scaled embeddings, local and
global rotary embeddings, q/k norms), token index = rotary position. The local layers get the same mask limited to
their sliding window (`mmspec.hf_cache.sliding_window_masks`): equal to transformers' while an image's block fits
in one window (Gemma 3: 256 image tokens, a 1024-token window; a model where it does not is refused).
"""

from __future__ import annotations

import torch

from mmspec.errors import check
from vlm.target import LlavaCachedLM, VLMInputs


def image_runs(is_image: torch.Tensor) -> torch.Tensor:
    """is_image [B, P] bool -> the index of each token's image run within its row [B, P] (0, 1, ..), -1 for text
    tokens: a run starts at an image token whose predecessor is not one."""
    before = torch.nn.functional.pad(is_image, (1, 0))[:, :-1]  # [B, P] the previous token is an image token
    starts = is_image & ~before  # [B, P]
    return torch.where(is_image, starts.long().cumsum(-1) - 1, -1)


def same_image_mask(is_image: torch.Tensor, num_keys: int) -> torch.Tensor:
    """is_image [B, P] -> [B, P, num_keys] True where query i and key j (j < P) are tokens of the same image."""
    run = image_runs(is_image)  # [B, P]
    same = (run.unsqueeze(-1) == run.unsqueeze(-2)) & (run >= 0).unsqueeze(-1)  # [B, P, P]
    return torch.nn.functional.pad(same, (0, num_keys - same.shape[-1]))  # [B, P, T]


class Gemma3CachedLM(LlavaCachedLM):
    """`Gemma3ForConditionalGeneration`: a fixed run of `mm_tokens_per_image` tokens per image (between the
    processor's begin- and end-of-image tokens), bidirectional inside the run during prefill."""

    family = "a transformers Gemma3ForConditionalGeneration"
    images_nested_per_row = True  # Gemma3Processor counts images per prompt

    def __init__(self, model, attention_backend: str | None = None) -> None:
        super().__init__(model, attention_backend)
        # the local layers see an image's whole block only if it fits one window (transformers lets image pairs
        # farther apart than the window attend; mmspec's window applies to them too)
        check(self.window is None or model.config.mm_tokens_per_image < self.window,
              f"Gemma 3's image blocks ({model.config.mm_tokens_per_image} tokens) do not fit its sliding window "
              f"({self.window}); mmspec supports Gemma 3 models whose window holds an image's tokens.")

    @property
    def fixed_image_tokens(self) -> int | None:
        return self.model.config.mm_tokens_per_image  # a square grid pooled from every image

    def feature_inputs(self, inputs: VLMInputs) -> dict:
        """Gemma 3's `get_image_features` reads the pixels only (SigLIP's last layer, pooled, projected)."""
        return {}

    def prompt_mask(self, inputs: VLMInputs, mask: torch.Tensor) -> torch.Tensor:
        """The prefill mask [B, P, T] (causal over each row's prompt) with each image's tokens seeing their whole
        image, as the model's own generation builds it from token_type_ids."""
        is_image = inputs.input_ids.to(mask.device) == self.image_token_id  # [B, P]
        return mask | same_image_mask(is_image, mask.shape[-1])
