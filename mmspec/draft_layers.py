"""The drafters' decoder layers: transformers `LlamaDecoderLayer` modules (mmspec's own drafter models, built from
a Llama config) run through mmspec's attention backends and `StaticKVCache`, with or without a cache.

The target never runs through here: it runs its own model's forward (`mmspec.hf_cache.run_text_model`).
"""

from __future__ import annotations

import torch

from mmspec.attention import attend
from mmspec.cache import StaticKVCache


def run_llama_layers(layers, rotary, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, *,
                     cache: StaticKVCache | None = None, slots: torch.Tensor | None = None,
                     first_layer_index: int = 0, backend: str | None = None) -> torch.Tensor:
    """transformers Llama decoder layers (`LlamaDecoderLayer`: their projections, norms, MLPs; RoPE from `rotary`,
    a `LlamaRotaryEmbedding`) over x [B, S, H] at positions [B, S] through mmspec's attention. With a cache,
    layer i writes its K/V at `slots` [B, S] (cache layer first_layer_index + i) and mask [B, S, T] covers the
    cache; without one, mask [B, S, S] covers x itself (training). Returns the last layer's output (no final
    norm) [B, S, H]. Autograd flows when called outside no_grad."""
    b, s, _ = x.shape
    positions = positions.expand(b, s).to(x.device)
    cos, sin = rotary(x, positions)  # [B, S, D] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, D]
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        num_heads = attn.q_proj.out_features // attn.head_dim
        num_kv_heads = attn.k_proj.out_features // attn.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, s, num_heads, attn.head_dim).transpose(1, 2)  # [B, Hq, S, D]
        k = attn.k_proj(h).view(b, s, num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = attn.v_proj(h).view(b, s, num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.write(first_layer_index + i, slots.expand(b, s), k, v)  # [B, Hkv, T, D]
        out = attend(q, k, v, mask, backend=backend, scale=attn.scaling)  # [B, Hq, S, D]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, num_heads * attn.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
