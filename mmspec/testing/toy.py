"""A tiny causal transformer LM (the "toy target") that drives the loop in tests and `mmspec selfcheck`.

It implements `mmspec.lm.CachedLM` with the project's static KV cache and attention registry, and also a plain
full-sequence `forward` with no cache, which the tests use as the independent reference.
"""

from __future__ import annotations

import torch
from torch import nn

from mmspec.attention import attend
from mmspec.cache import StaticKVCache


class ToyBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, layer: int, cache: StaticKVCache | None,
                slots: torch.Tensor | None, backend: str | None) -> torch.Tensor:
        b, s, d = x.shape
        h = self.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)  # each [B, H, S, hd]
        if cache is not None:
            k, v = cache.write(layer, slots, k, v)  # [B, H, T, hd]
        x = x + self.proj(attend(q, k, v, mask, backend=backend).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class ToyTransformer(nn.Module):
    """Causal LM with learned absolute positions; any size from its arguments."""

    def __init__(self, vocab_size: int = 16, dim: int = 32, num_layers: int = 2, num_heads: int = 2,
                 max_positions: int = 256, attention_backend: str | None = None):
        super().__init__()
        self.vocab_size, self.num_heads, self.head_dim = vocab_size, num_heads, dim // num_heads
        self.num_layers, self.attention_backend = num_layers, attention_backend
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_positions, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        p = self.head.weight
        return StaticKVCache(self.num_layers, batch_size, self.num_heads, capacity, self.head_dim, p.dtype, p.device)

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(positions)  # [B, S, dim]
        for i, block in enumerate(self.blocks):
            x = block(x, mask, i, cache, slots, self.attention_backend)
        return self.head(self.norm(x))  # [B, S, V]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full causal forward without a cache: tokens [B, T] -> logits [B, T, V]."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril().expand(b, t, t)
        x = self.tok(tokens) + self.pos(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, i, None, None, self.attention_backend)
        return self.head(self.norm(x))


def toy_model(seed: int = 0, **kwargs) -> ToyTransformer:
    """A randomly initialised toy target with a fixed seed (weights scaled up so its outputs are peaky)."""
    torch.manual_seed(seed)
    model = ToyTransformer(**kwargs).eval()
    with torch.no_grad():
        model.head.weight.mul_(6.0)
    return model
