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
    cos, sin = rope_cos_sin(rotary, x, positions)  # [B, S, D] each
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


ROPE_TABLE_POSITIONS = 8192  # positions a RoPE table holds (a larger max_position_embeddings is looked up to here)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # RoPE types whose frequencies follow the sequence length


def rope_cos_sin(rotary, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary(x, positions)` (cos, sin [B, S, D] at positions [B, S]). On a CPU without autograd they are looked
    up in a table of positions [0, min(max_position_embeddings, ROPE_TABLE_POSITIONS)) that `rotary` itself
    computed once per device, dtype and frequencies: the same numbers (each entry is its position times a
    frequency, then cos / sin), one operation instead of seven (a drafter's step on a CPU is bound by operation
    count). Positions past the table, RoPE types whose frequencies follow the sequence length, accelerators (an
    out-of-range lookup there is a device assert, not an error) and training compute them directly."""
    if (x.device.type != "cpu" or torch.is_grad_enabled() or getattr(rotary, "inv_freq", None) is None
            or getattr(rotary, "rope_type", "default") in LENGTH_DEPENDENT_ROPE):
        return rotary(x, positions)
    table = _rope_table(rotary, x)  # [L, 2D] cos | sin
    try:
        both = torch.nn.functional.embedding(positions, table)  # [B, S, 2D]
    except IndexError:  # a position past the table
        return rotary(x, positions)
    return both.chunk(2, dim=-1)


def _rope_table(rotary, x: torch.Tensor) -> torch.Tensor:
    key = (x.device, x.dtype, rotary.inv_freq.data_ptr(), float(getattr(rotary, "attention_scaling", 1.0)))
    cached = getattr(rotary, "_mmspec_rope_table", None)
    if cached is None or cached[0] != key:
        length = min(int(getattr(rotary, "original_max_seq_len", 0) or ROPE_TABLE_POSITIONS), ROPE_TABLE_POSITIONS)
        positions = torch.arange(length, device=x.device).unsqueeze(0)  # [1, L]
        cos, sin = rotary(x, positions)  # [1, L, D] each
        rotary._mmspec_rope_table = cached = (key, torch.cat([cos[0], sin[0]], dim=-1))  # [L, 2D]
    return cached[1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
