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
    cos, signed_sin = rope_rotation(rotary, x, positions)  # [B, S, D] each
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)  # [B, 1, S, D]
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        num_heads = attn.q_proj.out_features // attn.head_dim
        num_kv_heads = attn.k_proj.out_features // attn.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, s, num_heads, attn.head_dim).transpose(1, 2)  # [B, Hq, S, D]
        k = attn.k_proj(h).view(b, s, num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = attn.v_proj(h).view(b, s, num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = rotate_together(q, k, cos, signed_sin)
        if cache is not None:
            k, v = cache.write(first_layer_index + i, slots.expand(b, s), k, v)  # [B, Hkv, T, D]
        out = attend(q, k, v, mask, backend=backend, scale=attn.scaling)  # [B, Hq, S, D]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, num_heads * attn.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


ROPE_TABLE_POSITIONS = 8192  # positions a RoPE table holds (a larger max_position_embeddings is looked up to here)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # RoPE types whose frequencies follow the sequence length


def rope_rotation(rotary, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [B, S, D] at positions [B, S] for `rotate_together`: `rotary(x, positions)` with the sin's
    first half negated. On a CPU without autograd they are looked up in a table of positions [0,
    min(max_position_embeddings, ROPE_TABLE_POSITIONS)) that `rotary` itself computed once per device, dtype and
    frequencies: the same numbers (each entry is its position times a frequency, then cos / sin), one operation
    instead of seven (a drafter's step on a CPU is bound by operation count). Positions past the table, RoPE types
    whose frequencies follow the sequence length, accelerators (an out-of-range lookup there is a device assert,
    not an error) and training compute them directly."""
    if (x.device.type == "cpu" and not torch.is_grad_enabled() and getattr(rotary, "inv_freq", None) is not None
            and getattr(rotary, "rope_type", "default") not in LENGTH_DEPENDENT_ROPE):
        try:
            return torch.nn.functional.embedding(positions, _rope_table(rotary, x)).chunk(2, dim=-1)  # [B, S, D] x 2
        except IndexError:  # a position past the table
            pass
    return _signed(*rotary(x, positions))


def rotate_together(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb` for q [B, Hq, S, D] and k [B, Hkv, S, D] in one pass (cos, signed_sin
    [B, 1, S, D]): x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, D / 2) * signed_sin (the
    same products: (-a) * b = a * (-b)), so bit-identical in 5 operations instead of 10."""
    heads = q.shape[1]
    both = torch.cat((q, k), dim=1)  # [B, Hq + Hkv, S, D]
    both = both * cos + both.roll(both.shape[-1] // 2, dims=-1) * signed_sin
    return both[:, :heads], both[:, heads:]


def _signed(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin [.., D]) -> (cos, the sin with its first half negated)."""
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope_table(rotary, x: torch.Tensor) -> torch.Tensor:
    """[L, 2D] cos | signed sin for positions [0, L), made by `rotary` once per device, dtype and frequencies."""
    key = (x.device, x.dtype, rotary.inv_freq.data_ptr(), float(getattr(rotary, "attention_scaling", 1.0)))
    cached = getattr(rotary, "_mmspec_rope_table", None)
    if cached is None or cached[0] != key:
        length = min(int(getattr(rotary, "original_max_seq_len", 0) or ROPE_TABLE_POSITIONS), ROPE_TABLE_POSITIONS)
        positions = torch.arange(length, device=x.device).unsqueeze(0)  # [1, L]
        cos, sin = rotary(x, positions)  # [1, L, D] each
        rotary._mmspec_rope_table = cached = (key, torch.cat(_signed(cos[0], sin[0]), dim=-1))
    return cached[1]
