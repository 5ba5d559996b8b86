"""The drafters' decoder layers: transformers `LlamaDecoderLayer` modules (mmspec's own drafter models, built from
a Llama config) run through mmspec's attention backends and `StaticKVCache`, with or without a cache.

A layer whose input is wider than its output (EAGLE-3's [e ; g], `mmspec.eagle3`) names where its residual starts
in its `residual_from` attribute: x[..., residual_from:] is added to the attention's output (0, the whole input,
for a Llama layer).

The target never runs through here: it runs its own model's forward (`mmspec.hf_cache.run_text_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmspec.attention import attend
from mmspec.cache import StaticKVCache


def run_llama_layers(layers, rotary, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, *,
                     cache: StaticKVCache | None = None, slots: torch.Tensor | None = None,
                     first_layer_index: int = 0, backend: str | None = None, cache_only: bool = False,
                     query_column: torch.Tensor | None = None) -> torch.Tensor | None:
    """transformers Llama decoder layers (`LlamaDecoderLayer`: their projections, norms, MLPs; RoPE from `rotary`,
    a `LlamaRotaryEmbedding`) over x [B, S, H] at positions [B, S] through mmspec's attention. With a cache,
    layer i writes its K/V at `slots` [B, S] (cache layer first_layer_index + i) and mask [B, S, T] covers the
    cache; without one, mask [B, S, S] covers x itself (training). Returns the last layer's output (no final
    norm) [B, S, H]. Autograd flows when called outside no_grad. cache_only (a prompt pass that only fills the
    cache): the last layer writes its K/V and stops (`write_layer_kv`), and None is returned. query_column [B] (with
    a cache): the last layer writes every column's K/V, then runs on for that one column of each row alone
    (`run_layer_column`), and its output [B, 1, H] is returned."""
    b, s, _ = x.shape
    positions = positions.expand(b, s).to(x.device)
    cos, signed_sin = rope_rotation(rotary, x, positions)  # [B, S, D] each
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)  # [B, 1, S, D]
    # inference: the layers' weights as one plan each (`inference_plan`: q|k|v and gate|up one product each);
    # autograd and torch.compile (which fuses by itself and would not trace the plan's checks) run the modules
    planned = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    for i, layer in enumerate(layers):
        plan = inference_plan(layer) if planned else None
        if (cache_only or query_column is not None) and i == len(layers) - 1:
            keys, values = write_layer_kv(layer, plan, x, cos, signed_sin, cache, slots, first_layer_index + i)
            if cache_only:
                return None
            return run_layer_column(layer, plan, x, cos, signed_sin, mask, keys, values, query_column, backend)
        if plan is not None:
            x = run_planned_layer(plan, x, cos, signed_sin, mask, cache, slots, first_layer_index + i, backend)
        else:
            x = run_module_layer(layer, x, cos, signed_sin, mask, cache, slots, first_layer_index + i, backend)
    return x


def run_module_layer(layer, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, mask: torch.Tensor | None,
                     cache: StaticKVCache | None, slots: torch.Tensor | None, cache_layer: int,
                     backend: str | None) -> torch.Tensor:
    """One `LlamaDecoderLayer` over x [B, S, H] (cos, signed_sin [B, 1, S, D]) through its own modules' forwards."""
    b, s, _ = x.shape
    attn = layer.self_attn
    num_heads = attn.q_proj.out_features // attn.head_dim
    num_kv_heads = attn.k_proj.out_features // attn.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(b, s, num_heads, attn.head_dim).transpose(1, 2)  # [B, Hq, S, D]
    k = attn.k_proj(h).view(b, s, num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    v = attn.v_proj(h).view(b, s, num_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = rotate_together(q, k, cos, signed_sin)
    if cache is not None:
        k, v = cache.write(cache_layer, slots.expand(b, s), k, v)  # [B, Hkv, T, D]
    return finish_module_layer(layer, x, attend(q, k, v, mask, backend=backend, scale=attn.scaling))


def finish_module_layer(layer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A `LlamaDecoderLayer` past its attention, through its own modules: x [B, S, H] the layer's input, out
    [B, Hq, S, D] the attention's output -> the layer's output [B, S, H] (o projection, MLP, both residuals)."""
    b, heads, s, head_dim = out.shape
    x = x[..., getattr(layer, "residual_from", 0):] + layer.self_attn.o_proj(out.transpose(1, 2).reshape(
        b, s, heads * head_dim))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def write_layer_kv(layer, plan: LayerPlan | None, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   cache: StaticKVCache, slots: torch.Tensor, cache_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What later steps read of one decoder layer over x [B, S, H] (cos, signed_sin [B, 1, S, D]): its K/V, written
    at slots [B, S] (the input norm, the k and v projections, k's rotation: the same numbers as the whole layer's).
    A prompt pass that only fills the cache stops here: the layer's queries, attention, o projection and MLP feed
    nothing, and they are about 5/6 of a Llama layer's products (the world LLaVA's EagleVLM prompt pass at batch 32
    on a 2-core CPU, 2026-11-28: 14 ms where the whole layer took 52).
    Returns the cache's keys and values [B, Hkv, T, D] (`StaticKVCache.write`)."""
    b, s, _ = x.shape
    if plan is not None:
        kv_heads, start = plan.num_kv_heads, plan.num_heads * plan.head_dim  # k|v rows start after q's
        weight, bias = plan.qkv  # [(Hq + 2 Hkv) D, H]
        h = x if plan.input_norm is None else plan.input_norm(x)
        kv = F.linear(h, weight[start:], None if bias is None else bias[start:])  # [B, S, 2 Hkv D]
        kv = kv.view(b, s, 2 * kv_heads, plan.head_dim).transpose(1, 2)  # [B, 2 Hkv, S, D]
        k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    else:
        attn = layer.self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        h = layer.input_layernorm(x)
        k = attn.k_proj(h).view(b, s, kv_heads, attn.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = attn.v_proj(h).view(b, s, kv_heads, attn.head_dim).transpose(1, 2)
    return cache.write(cache_layer, slots.expand(b, s), rotate_heads(k, cos, signed_sin), v)


def run_layer_column(layer, plan: LayerPlan | None, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                     mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor,
                     backend: str | None) -> torch.Tensor:
    """One decoder layer for one column of each row, its K/V already written (`write_layer_kv`: keys, values
    [B, Hkv, T, D]): x [B, S, H] the layer's input, cos, signed_sin [B, 1, S, D], mask [B, S, T], column [B] ->
    the layer's output at that column [B, 1, H]. A drafter's pending pairs need every column's K/V but the output
    of each row's last one alone (`FeatureTreeDrafter.run_pending`)."""
    b, _, hidden = x.shape
    x = x.gather(1, column.view(b, 1, 1).expand(b, 1, hidden))  # [B, 1, H]
    at = column.view(b, 1, 1, 1).expand(b, 1, 1, cos.shape[-1])  # [B, 1, 1, D]
    cos, signed_sin = cos.gather(2, at), signed_sin.gather(2, at)  # [B, 1, 1, D] each
    mask = mask.gather(1, column.view(b, 1, 1).expand(b, 1, mask.shape[-1]))  # [B, 1, T]
    if plan is not None:
        weight, bias = plan.qkv
        size = plan.num_heads * plan.head_dim  # q's rows come first
        h = x if plan.input_norm is None else plan.input_norm(x)
        q = F.linear(h, weight[:size], None if bias is None else bias[:size])  # [B, 1, Hq D]
        q = rotate_heads(q.view(b, 1, plan.num_heads, plan.head_dim).transpose(1, 2), cos, signed_sin)
        return finish_planned_layer(plan, x, attend(q, keys, values, mask, backend=backend, scale=plan.scaling))
    attn = layer.self_attn
    q = attn.q_proj(layer.input_layernorm(x)).view(b, 1, -1, attn.head_dim).transpose(1, 2)  # [B, Hq, 1, D]
    q = rotate_heads(q, cos, signed_sin)
    return finish_module_layer(layer, x, attend(q, keys, values, mask, backend=backend, scale=attn.scaling))


@dataclass(frozen=True)
class LayerPlan:
    """What an inference forward of one `LlamaDecoderLayer` reads, looked up once: head counts, the norms and the
    activation (the layer's own modules; input_norm None for an Identity), q|k|v and gate|up concatenated
    [(Hq + 2 Hkv) D, H] and [2F, H] (biases None where the projections have none), o and down as they are."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    input_norm: torch.nn.Module | None
    post_norm: torch.nn.Module
    act_fn: torch.nn.Module
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    residual_from: int = 0  # the input channel the residual starts at (see the module docstring)


PLAN_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                    ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def plan_key(layer) -> tuple:
    """What a plan must still match: every projection module and its parameters (the same objects, at the same
    version and storage: an optimizer step, `load_state_dict` or a move changes one) and the norm and activation
    modules. Read through the modules' own dictionaries (`nn.Module.__getattr__` costs ~0.4 us a name, and this runs
    every step). Weights made under `torch.inference_mode` keep no version: their storage and identity alone are
    compared."""
    modules = layer._modules
    key = [id(modules["input_layernorm"]), id(modules["post_attention_layernorm"]), id(modules["mlp"].act_fn)]
    for parent, name in PLAN_PROJECTIONS:
        projection = modules[parent]._modules[name]
        key.append(id(projection))
        for tensor in projection._parameters.values():
            if tensor is None:
                key.append(None)
            else:
                key += id(tensor), -1 if tensor.is_inference() else tensor._version, tensor.data_ptr()
    return tuple(key)


def inference_plan(layer) -> LayerPlan | None:
    """The layer's `LayerPlan`, kept on the layer while `plan_key` holds; None (the modules' own forwards) where a
    projection is not a plain `nn.Linear` (a wrapped or adapted one computes more than its weight). The concatenated
    products are the same (each output column is its own row's dot product; bit-identical on this CPU): one
    forward runs 4 products where it ran 7, and a drafter's one-token step on a CPU is bound by operation count.
    Costs a second copy of the q, k, v, gate and up weights (inference only)."""
    key = plan_key(layer)
    cached = layer.__dict__.get("_mmspec_plan")
    if cached is not None and cached[0] == key:
        return cached[1]
    attn, mlp = layer.self_attn, layer.mlp
    if any(type(getattr(layer, parent)._modules[name]) is not torch.nn.Linear for parent, name in PLAN_PROJECTIONS):
        layer.__dict__["_mmspec_plan"] = (key, None)
        return None

    def joined(*modules) -> tuple[torch.Tensor, torch.Tensor | None]:
        biases = [m.bias for m in modules]
        return (torch.cat([m.weight for m in modules]).detach(),
                None if biases[0] is None else torch.cat(biases).detach())

    def own(module) -> tuple[torch.Tensor, torch.Tensor | None]:
        return module.weight.detach(), None if module.bias is None else module.bias.detach()

    norm = layer.input_layernorm
    plan = LayerPlan(attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim,
                     attn.head_dim, attn.scaling, None if isinstance(norm, torch.nn.Identity) else norm,
                     layer.post_attention_layernorm, mlp.act_fn, joined(attn.q_proj, attn.k_proj, attn.v_proj),
                     joined(mlp.gate_proj, mlp.up_proj), own(attn.o_proj), own(mlp.down_proj),
                     getattr(layer, "residual_from", 0))
    layer.__dict__["_mmspec_plan"] = (key, plan)
    return plan


def run_planned_layer(plan: LayerPlan, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                      mask: torch.Tensor | None, cache: StaticKVCache | None, slots: torch.Tensor | None,
                      cache_layer: int, backend: str | None) -> torch.Tensor:
    """One decoder layer from its plan over x [B, S, H] (cos, signed_sin [B, 1, S, D]): the modules' forward,
    with q|k|v and gate|up as one product each."""
    b, s, _ = x.shape
    heads, kv_heads = plan.num_heads, plan.num_kv_heads
    h = x if plan.input_norm is None else plan.input_norm(x)
    qkv = F.linear(h, *plan.qkv).view(b, s, heads + 2 * kv_heads, plan.head_dim).transpose(1, 2)  # [B, Hq+2Hkv, S, D]
    q_and_k = rotate_heads(qkv[:, :heads + kv_heads], cos, signed_sin)  # [B, Hq + Hkv, S, D]
    q, k, v = q_and_k[:, :heads], q_and_k[:, heads:], qkv[:, heads + kv_heads:]
    if cache is not None:
        k, v = cache.write(cache_layer, slots.expand(b, s), k, v)  # [B, Hkv, T, D]
    return finish_planned_layer(plan, x, attend(q, k, v, mask, backend=backend, scale=plan.scaling))


def finish_planned_layer(plan: LayerPlan, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`finish_module_layer` from a plan: x [B, S, H], the attention's output out [B, Hq, S, D] -> [B, S, H]."""
    b, heads, s, head_dim = out.shape
    x = x[..., plan.residual_from:] + F.linear(out.transpose(1, 2).reshape(b, s, heads * head_dim), *plan.o)
    gate, up = F.linear(plan.post_norm(x), *plan.gate_up).chunk(2, dim=-1)  # [B, S, F] each
    return x + F.linear(plan.act_fn(gate) * up, *plan.down)


def rotate_heads(heads: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotate_together`'s rotation of q and k already side by side, heads [B, Hq + Hkv, S, D] (cos, signed_sin
    [B, 1, S, D]): no concatenation."""
    return heads * cos + heads.roll(heads.shape[-1] // 2, dims=-1) * signed_sin


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
    both = rotate_heads(torch.cat((q, k), dim=1), cos, signed_sin)  # [B, Hq + Hkv, S, D]
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
