"""The training-free VLM drafter kinds: prompt lookup (`pld`, `mmspec.lookup`), its suffix automaton (`sam`) and
Token Recycling (`recycle`, `mmspec.recycle`): no weights, nothing to train, any target.

    vlm = SpeculativeVLM.from_pretrained(folder, drafter="pld")          # or SpeculativeVLM(model, processor,
    out = vlm.generate(images, prompts, max_new_tokens=256)              #     VLMPromptLookup(num_draft_tokens=8))

`pld` drafts chains copied from the row's own prompt and answer (`PromptLookupDrafter`); `tree` / vLLM's
`num_speculative_tokens=K` set the chain's length K, a tree with top_k > 1 is refused in one line; `sam` drafts the
same chains from the row's longest repeated suffix (`SuffixLookupDrafter`). `recycle`
drafts trees from the target's own earlier rankings (`TokenRecyclingDrafter`, its table kept in the kind's object
across calls). None proposes the target's vision placeholder or delimiter tokens (`vision_token_ids`).
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.errors import check
from mmspec.lookup import PromptLookupDrafter, SuffixLookupDrafter

VISION_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                       "vision_start_token_id", "vision_end_token_id", "boi_token_index", "eoi_token_index")


def vision_token_ids(config: Any) -> list[int]:
    """The placeholder and delimiter ids of a transformers VLM config (LLaVA, LLaVA-OneVision's video token, Qwen2-VL,
    Gemma 3) that no draft may propose."""
    return sorted({int(v) for name in VISION_TOKEN_FIELDS if isinstance(v := getattr(config, name, None), int)})


class VLMPromptLookup(torch.nn.Module):
    """The `pld` drafter kind: PromptLookupDrafter's settings, attached to a target (its vision tokens banned).
    A module without parameters, so it moves, casts and saves like the trained kinds."""

    drafter_class = PromptLookupDrafter

    def __init__(self, num_draft_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        PromptLookupDrafter(num_draft_tokens, max_ngram, min_ngram)  # (checks the settings now)
        self.num_draft_tokens, self.max_ngram, self.min_ngram = num_draft_tokens, max_ngram, min_ngram
        self.banned: list[int] = []

    def attach(self, lm: Any) -> VLMPromptLookup:
        self.banned = vision_token_ids(lm.model.config)
        return self

    def image_tokens_attended(self, image_tokens: float) -> float:
        return 0.0  # it reads token ids only

    @staticmethod
    def loop_drafter(drafter: VLMPromptLookup, lm: Any, params: Any, top_k: int | None = None,
                     depth: int | None = None, total_tokens: int | None = None,
                     child_ranking: str = "raw") -> PromptLookupDrafter:
        """The loop's drafter for one call: chains of `depth` drafts when the call gives a chain (top_k 1), else
        the configured num_draft_tokens."""
        check(top_k in (None, 1), f"the pld drafter drafts chains: give tree=(K, 1, K + 1) or "
                                  f"num_speculative_tokens=K, not top_k={top_k}.")
        k = drafter.num_draft_tokens if depth is None else depth
        return drafter.drafter_class(k, drafter.max_ngram, drafter.min_ngram, drafter.banned)


class VLMSuffixLookup(VLMPromptLookup):
    """The `sam` drafter kind: prompt lookup of the row's longest repeated suffix through a suffix automaton per row
    (`SuffixLookupDrafter`, SAM decoding's dynamic automaton); chains as `pld`."""

    drafter_class = SuffixLookupDrafter

    def __init__(self, num_draft_tokens: int = 10, min_ngram: int = 1) -> None:
        super().__init__(num_draft_tokens, max_ngram=max(min_ngram, 1), min_ngram=min_ngram)


class VLMTokenRecycling(torch.nn.Module):
    """The `recycle` drafter kind: Token Recycling (`mmspec.recycle`) on a VLM target. Its adjacency table (the
    target's top `candidates` next tokens after each token) lives in this object, so it keeps learning across the
    calls of a pipeline; the target's vision tokens are never drafted. `tree` sets the drafted tree's
    (depth, top_k, total_tokens), the budget smaller shapes and chains inside it."""

    def __init__(self, candidates: int = 8, top_k: int = 8, depth: int = 6, total_tokens: int = 48) -> None:
        super().__init__()
        from mmspec.recycle import AdjacencyTable, TokenRecyclingDrafter

        TokenRecyclingDrafter(AdjacencyTable(2, candidates), top_k, depth, total_tokens)  # (checks the settings)
        self.candidates, self.top_k, self.depth, self.total_tokens = candidates, top_k, depth, total_tokens
        self.banned: list[int] = []
        self.table = None  # made at attach, for the target's vocabulary

    def attach(self, lm: Any) -> VLMTokenRecycling:
        from mmspec.recycle import AdjacencyTable

        self.banned = vision_token_ids(lm.model.config)
        if self.table is None or self.table.next_tokens.shape[0] != lm.vocab_size:
            self.table = AdjacencyTable(lm.vocab_size, self.candidates)
        return self

    def image_tokens_attended(self, image_tokens: float) -> float:
        return 0.0  # it reads token ids only

    @staticmethod
    def loop_drafter(drafter: VLMTokenRecycling, lm: Any, params: Any, top_k: int | None = None,
                     depth: int | None = None, total_tokens: int | None = None, child_ranking: str = "raw"):
        """The loop's drafter for one call over the kind's table: `tree` entries given, else the kind's own."""
        from mmspec.recycle import TokenRecyclingDrafter

        return TokenRecyclingDrafter(drafter.table, top_k or drafter.top_k, depth or drafter.depth,
                                     total_tokens or drafter.total_tokens, drafter.banned)
