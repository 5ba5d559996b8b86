"""Toy drafters for tests: random chain drafts (nothing gets accepted, everything must still be exact)."""

from __future__ import annotations

import torch

from mmspec.loop import DecodeState
from mmspec.verify import ChainDraft


class RandomDrafter:
    """Uniformly random draft tokens without a distribution (one-hot q), with a ragged length per row."""

    def __init__(self, vocab_size: int, num_draft_tokens: int, seed: int = 0, ragged: bool = True):
        self.vocab_size, self.k, self.ragged = vocab_size, num_draft_tokens, ragged
        self.generator = torch.Generator().manual_seed(seed)
        self.forwards = 0

    def begin(self, inputs, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> ChainDraft:
        b = state.batch_size
        tokens = torch.randint(0, self.vocab_size, (b, self.k), generator=self.generator)
        num = torch.randint(0, self.k + 1, (b,), generator=self.generator) if self.ragged else None
        if num is not None:
            tokens = torch.where(torch.arange(self.k) < num.unsqueeze(-1), tokens, -1)
        return ChainDraft(tokens.to(state.done.device), None, None if num is None else num.to(state.done.device))

    def observe(self, state, draft, result, active, target_probs) -> None:
        pass
