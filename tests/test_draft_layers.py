"""The drafters' decoder layers (`mmspec.draft_layers`): the RoPE table gives the rotary embedding's own numbers."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from mmspec.draft_layers import rope_rotation, rotate_together

SCALINGS = [None, {"rope_type": "linear", "factor": 2.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
            {"rope_type": "dynamic", "factor": 2.0}]


def rotary_signed(rotary, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary(x, positions)` with the sin's first half negated (what `rope_rotation` gives)."""
    cos, sin = rotary(x, positions)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_gives_the_rotary_embeddings_numbers(scaling, dtype) -> None:
    """Looked up in the table (or, past it and for length-dependent types, computed): bit-identical to
    `rotary(x, positions)` (its sin signed), for positions inside the table, at its last entry and past it."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=300, rope_scaling=scaling)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(2, 3, 64).to(dtype)
    for positions in ([[0, 5, 299], [17, 18, 19]], [[298, 299, 300], [1000, 3, 4]]):
        positions = torch.tensor(positions)
        with torch.no_grad():
            looked_up, direct = rope_rotation(rotary, x, positions), rotary_signed(rotary, x, positions)
        assert all(torch.equal(a, b) for a, b in zip(looked_up, direct))
        assert looked_up[0].dtype == dtype and looked_up[0].shape == (2, 3, 16)


def test_rope_table_follows_the_frequencies() -> None:
    """A rotary whose frequencies changed (another model's buffers) gets a new table, not the old one's numbers."""
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64))
    x, positions = torch.randn(1, 2, 64), torch.tensor([[3, 40]])
    with torch.no_grad():
        rope_rotation(rotary, x, positions)
        rotary.inv_freq = rotary.inv_freq * 0.5
        assert all(torch.equal(a, b) for a, b in zip(rope_rotation(rotary, x, positions),
                                                     rotary_signed(rotary, x, positions)))


@pytest.mark.parametrize("grad", [False, True])
def test_q_and_k_rotated_together_give_transformers_rotation(grad) -> None:
    """`rotate_together` with `rope_rotation`'s signed sin (table lookup without autograd, computed with it) equals
    transformers' `apply_rotary_pos_emb` bit for bit, grouped-query shapes included."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    rotary = LlamaRotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    positions = torch.randint(0, 300, (2, 5), generator=g)  # some past the table
    with torch.no_grad():
        want = apply_rotary_pos_emb(q, k, *rotary(q, positions))
    with torch.set_grad_enabled(grad):
        cos, signed_sin = rope_rotation(rotary, q, positions)
        got = rotate_together(q, k, cos.unsqueeze(1), signed_sin.unsqueeze(1))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def llama_layers(bias: bool, kv_heads: int,
                 wrap_last: bool = False) -> tuple[torch.nn.ModuleList, LlamaRotaryEmbedding]:
    """Two seeded Llama decoder layers; wrap_last: the last one's up projection is a `nn.Linear` subclass with the
    same weights, so that layer gets no plan and runs through its modules."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, intermediate_size=96,
                         attention_bias=bias, mlp_bias=bias, max_position_embeddings=128, num_hidden_layers=2)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([LlamaDecoderLayer(config, layer_idx=i) for i in range(2)])
    if bias:  # transformers zero-initialises biases: make them count
        for name, parameter in layers.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(parameter)
    if wrap_last:
        class Wrapped(torch.nn.Linear):
            pass
        wrapped = Wrapped(64, 96, bias=bias)
        wrapped.load_state_dict(layers[-1].mlp.up_proj.state_dict())
        layers[-1].mlp.up_proj = wrapped
    return layers, LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("bias,kv_heads", [(False, 4), (True, 2)], ids=["plain", "bias-gqa"])
def test_fused_projections_give_the_modules_numbers(bias, kv_heads) -> None:
    """Without autograd the layers run q|k|v and gate|up as one product each (`inference_plan`): the same outputs
    as the modules' own projections (run with autograd), through a cache as without one."""
    from mmspec.cache import StaticKVCache
    from mmspec.draft_layers import run_llama_layers

    layers, rotary = llama_layers(bias, kv_heads)
    x, positions = torch.randn(3, 5, 64), torch.arange(1, 6).unsqueeze(0)
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(3, -1, -1)
    want = run_llama_layers(layers, rotary, x, positions, mask).detach()
    with torch.no_grad():
        got = run_llama_layers(layers, rotary, x, positions, mask)
        cache = StaticKVCache(2, 3, kv_heads, 8, 16, torch.float32, "cpu")
        slots = cache.slots(5)
        with cache.keys_up_to(5):
            cached = run_llama_layers(layers, rotary, x, positions, cache.attention_mask(slots), cache=cache,
                                      slots=slots)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cached, want, rtol=1e-6, atol=1e-6)
    assert layers[0].__dict__["_mmspec_plan"][1] is not None


def test_fused_projections_follow_the_weights() -> None:
    """A weight changed in place (an optimizer step, `load_state_dict`), a weight replaced and a norm replaced each
    give a new plan, not stale weights."""
    from mmspec.draft_layers import run_llama_layers

    layers, rotary = llama_layers(False, 4)
    x, positions = torch.randn(1, 3, 64), torch.arange(3).unsqueeze(0)
    mask = torch.ones(3, 3, dtype=torch.bool).tril().unsqueeze(0)
    changes = [lambda: layers[1].self_attn.k_proj.weight.mul_(2.0), lambda: layers[0].mlp.up_proj.weight.add_(0.5),
               lambda: setattr(layers[0].mlp.down_proj, "weight", torch.nn.Parameter(torch.randn(64, 96))),
               lambda: setattr(layers[1], "input_layernorm", torch.nn.Identity())]
    for change in changes:
        with torch.no_grad():
            before = run_llama_layers(layers, rotary, x, positions, mask)
            change()
            after = run_llama_layers(layers, rotary, x, positions, mask)
        want = run_llama_layers(layers, rotary, x, positions, mask).detach()  # the modules' own projections
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, want, rtol=1e-6, atol=1e-6)


def test_layers_made_under_inference_mode_run_from_a_plan() -> None:
    """Weights created under `torch.inference_mode` track no version: the plan is keyed without it, and the
    layers give the modules' numbers."""
    from mmspec.draft_layers import run_llama_layers

    x, positions = torch.randn(2, 4, 64), torch.arange(4).unsqueeze(0)
    mask = torch.ones(4, 4, dtype=torch.bool).tril().expand(2, -1, -1)
    layers, rotary = llama_layers(True, 2)
    want = run_llama_layers(layers, rotary, x, positions, mask).detach()
    with torch.inference_mode():
        made, made_rotary = llama_layers(True, 2)
        assert made[0].self_attn.q_proj.weight.is_inference()
        got = run_llama_layers(made, made_rotary, x, positions, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_wrapped_projection_runs_through_its_own_module() -> None:
    """A projection that is not a plain `nn.Linear` (an adapter adding to its weight's product) gets no plan: the
    layers run the modules' own forwards, adapter included, and a plain one put back is planned again."""
    from mmspec.draft_layers import run_llama_layers

    class Adapted(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + 1.0

    layers, rotary = llama_layers(False, 4)
    x, positions = torch.randn(1, 3, 64), torch.arange(3).unsqueeze(0)
    mask = torch.ones(3, 3, dtype=torch.bool).tril().unsqueeze(0)
    plain = layers[0].mlp.up_proj
    adapted = Adapted(64, 96, bias=False)
    adapted.weight = plain.weight
    layers[0].mlp.up_proj = adapted
    want = run_llama_layers(layers, rotary, x, positions, mask).detach()
    with torch.no_grad():
        got = run_llama_layers(layers, rotary, x, positions, mask)
        assert layers[0].__dict__["_mmspec_plan"][1] is None and layers[1].__dict__["_mmspec_plan"][1] is not None
        layers[0].mlp.up_proj = plain
        back = run_llama_layers(layers, rotary, x, positions, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(back, got) and layers[0].__dict__["_mmspec_plan"][1] is not None


@pytest.mark.parametrize("bias,kv_heads", [(False, 4), (True, 2)], ids=["plain", "bias-gqa"])
@pytest.mark.parametrize("adapted", [False, True], ids=["planned", "modules"])
def test_a_cache_only_pass_writes_the_whole_passs_keys_and_values(bias, kv_heads, adapted) -> None:
    """`cache_only` (a prompt pass that only fills the cache) runs the last layer to its K/V alone: every cache
    layer holds the whole pass's keys and values bit for bit, from the plan and from the modules (a wrapped
    projection), and the pass returns None; later queries through the cache then see the same numbers."""
    from mmspec.cache import StaticKVCache
    from mmspec.draft_layers import run_llama_layers

    layers, rotary = llama_layers(bias, kv_heads, wrap_last=adapted)
    g = torch.Generator().manual_seed(1)
    x, positions = torch.randn(3, 5, 64, generator=g), torch.tensor([[2, 3, 4, 5, 6], [0, 1, 2, 3, 4], [9, 8, 7, 6, 5]])
    caches = []
    with torch.no_grad():
        for cache_only in (False, True):
            cache = StaticKVCache(2, 3, kv_heads, 8, 16, torch.float32, "cpu")
            for stale in cache.k + cache.v:  # stale entries: a slot the pass did not write keeps its own
                stale.normal_(generator=g)
            slots = cache.slots(5)
            with cache.keys_up_to(5):
                out = run_llama_layers(layers, rotary, x, positions, cache.attention_mask(slots), cache=cache,
                                       slots=slots, cache_only=cache_only)
            assert (out is None) == cache_only
            caches.append(cache)
    assert (layers[1].__dict__["_mmspec_plan"][1] is None) == adapted
    full, only = caches
    for layer in range(2):
        for a, b in ((full.k[layer], only.k[layer]), (full.v[layer], only.v[layer])):  # [B, Hkv, T, D]
            assert torch.equal(a[:, :, :5], b[:, :, :5]) and not torch.equal(a[:, :, 5:], b[:, :, 5:])


@pytest.mark.parametrize("bias,kv_heads", [(False, 4), (True, 2)], ids=["plain", "bias-gqa"])
@pytest.mark.parametrize("adapted", [False, True], ids=["planned", "modules"])
def test_one_column_per_row_gives_the_whole_passs_output_there(bias, kv_heads, adapted) -> None:
    """`query_column` [B] (a drafter's pending pairs, of which only each row's last is read): every column's K/V
    written as by the whole pass, and the output [B, 1, H] is the whole pass's at each row's column, from the plan
    and from the modules; a wrong column would give another column's output."""
    from mmspec.cache import StaticKVCache
    from mmspec.draft_layers import run_llama_layers

    layers, rotary = llama_layers(bias, kv_heads, wrap_last=adapted)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 64, generator=g)
    positions = torch.tensor([[2, 3, 4, 5, 6], [0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    column = torch.tensor([4, 0, 2])
    outs, caches = [], []
    with torch.no_grad():
        for query in (None, column):
            cache = StaticKVCache(2, 3, kv_heads, 8, 16, torch.float32, "cpu")
            cache.lengths += torch.tensor([1, 0, 2])  # committed prefixes of different lengths
            slots = cache.slots(5)
            with cache.keys_up_to(8):
                outs.append(run_llama_layers(layers, rotary, x, positions, cache.attention_mask(slots), cache=cache,
                                             slots=slots, query_column=query))
            caches.append(cache)
    full, one = outs
    assert one.shape == (3, 1, 64)
    torch.testing.assert_close(one[:, 0], full[torch.arange(3), column], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(one[:, 0], full[torch.arange(3), column.flip(0)])
    assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))
