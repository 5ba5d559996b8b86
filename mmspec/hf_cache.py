"""A transformers text model run through its own modules over mmspec's `StaticKVCache`.

Speculative verification needs three things transformers' caches do not give together: per-row lengths (ragged
batches), a 4-D tree mask over the cache, and compaction of an accepted tree path. mmspec's `StaticKVCache` has
them; `SlotCache` is a thin transformers `Cache` in front of it, so the model's own decoder layers (projections,
q/k norms, rotary embeddings, attention implementation, MLPs) compute each step and write their keys and values
at the step's cache slots:

    h = run_text_model(model.model.language_model, embeds, positions, cache, slots, mask)   # [B, S, H] post-norm
    logits = model.lm_head(h)

`mask` is mmspec's [B, S, T] boolean (True = attend) from `cache.attention_mask`; transformers takes it as a 4-D
mask unchanged (no mask building), as an additive float mask (0 / dtype min) because its eager attention ADDS the
mask. Exactness then comes from transformers, not from a copy of its layers.

`attention_backend` (an mmspec backend name, e.g. "triton") runs the attention through `mmspec.attention.attend`
instead of the model's own implementation, for one call (the model's config is restored afterwards).

Glossary: B rows, S new entries this step, T key slots attended (`cache.num_keys`), Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from mmspec.attention import attend
from mmspec.cache import StaticKVCache
from mmspec.errors import check

MMSPEC_ATTENTION = "mmspec"  # the name mmspec's attention is registered under in transformers' AttentionInterface
OWN_MASK_IMPLEMENTATIONS = ("eager", "sdpa", MMSPEC_ATTENTION)  # attention that applies a 4-D mask as given


class SlotCache(Cache):
    """A transformers `Cache` that writes each layer's new keys/values at `slots` [B, S] of `cache` and hands the
    layer the keys/values of slots [0, T) (the mask hides what a row must not see)."""

    def __init__(self, cache: StaticKVCache, slots: torch.Tensor) -> None:
        super().__init__(layers=[])
        self.cache, self.slots = cache, slots  # slots [B, S]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states [B, Hkv, S, D] -> the layer's keys, values [B, Hkv, T, D]."""
        b, _, s, _ = key_states.shape
        return self.cache.write(layer_idx, self.slots.expand(b, s), key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.cache.lengths.max())

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.cache.num_keys, 0

    def __len__(self) -> int:
        return len(self.cache.k)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mmspec's boolean mask [B, S, T] (True = attend) -> transformers' 4-D additive mask [B, 1, S, T]."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min).unsqueeze(1)


_ZEROS: dict = {}  # (dtype, device) -> the largest zero additive mask made yet [1, 1, 1, T]


def zero_mask(b: int, s: int, t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 4-D additive mask [B, 1, S, T] that lets every query see every key: a broadcast view of one zeros
    tensor kept per dtype and device (no operation per step; what `additive_mask` makes of an all-True mask)."""
    zeros = _ZEROS.get((dtype, device))
    if zeros is None or zeros.shape[-1] < t:
        zeros = _ZEROS[(dtype, device)] = torch.zeros(1, 1, 1, max(t, 1024), dtype=dtype, device=device)
    return zeros[..., :t].expand(b, 1, s, t)


def mmspec_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over `mmspec.attention.attend`: query [B, Hq, S, D], key and
    value [B, Hkv, T, D], attention_mask [B, 1, S, T] additive -> output [B, S, Hq, D] (transformers' layout)."""
    # a sliding_window kwarg needs nothing: the mask the layer gets already applies the window
    check(kwargs.get("softcap") is None, f"{type(module).__name__} soft-caps its attention logits, which mmspec's "
          "attention backends do not; leave attention_backend unset to run the model's own attention.")
    mask = None if attention_mask is None else attention_mask[:, 0] == 0  # [B, S, T] True = attend
    out = attend(query, key, value, mask, backend=kwargs.get("mmspec_backend"), scale=scaling)  # [B, Hq, S, D]
    return out.transpose(1, 2).contiguous(), None


def register_mmspec_attention() -> None:
    """Make `mmspec_attention` selectable in transformers under MMSPEC_ATTENTION (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(MMSPEC_ATTENTION, mmspec_attention)


@contextmanager
def attention_implementation(config, name: str | None) -> Iterator[None]:
    """Within the block, `config` (a text model's config) uses attention `name`; None leaves it as it is."""
    if name is None:
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def check_attention_support(config, where: str, attention_backend: str | None = None) -> None:
    """InputError unless `config`'s attention implementation applies a 4-D mask as given (eager, sdpa): flash
    attention takes padding masks only, so tree verification would silently attend to the wrong keys. With an
    mmspec `attention_backend`, also unless the model's attention needs nothing mmspec's backends lack."""
    name = getattr(config, "_attn_implementation", None) or "eager"
    check(name in OWN_MASK_IMPLEMENTATIONS,
          f"{where} uses attention {name!r}, which cannot apply a tree mask; load it with "
          "attn_implementation='sdpa' (or 'eager').")
    check(attention_backend is None or not getattr(config, "attn_logit_softcapping", None),
          f"{where} soft-caps its attention logits, which mmspec's attention backend {attention_backend!r} does "
          "not; leave attention_backend unset to run the model's own attention.")


def cache_argument(text_model) -> str:
    """The name a text model's forward takes its cache under: `cache` (transformers >= 5.24) or `past_key_values`."""
    return _cache_argument(type(text_model))


@functools.cache
def _cache_argument(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def sliding_window_masks(config, mask: torch.Tensor, slots: torch.Tensor, seq_positions: torch.Tensor,
                         window: int, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask(s) of a text model with sliding-window layers, as transformers builds them for a sequence:
    a query at sequence index q sees a key at index k only if q - k < window (on top of `mask` [B, S, T]). Keys'
    indices: committed slots are their own index, this step's entries (at `slots` [B, S]) their `seq_positions`
    [B, S] (a tree node: the row's length + its depth). A model with `layer_types` takes a dict by layer type (Gemma
    2/3, Qwen2/3 with sliding layers); one without (Mistral) applies the window on every layer."""
    b, _, t = mask.shape
    keys = torch.arange(t, device=mask.device).expand(b, t).scatter(1, slots.clamp_max(t - 1), seq_positions)  # [B, T]
    near = (seq_positions.unsqueeze(-1) - keys.unsqueeze(1)) < window  # [B, S, T]
    sliding = additive_mask(mask & near, dtype)
    if getattr(config, "layer_types", None) is None:
        return sliding
    return {"full_attention": additive_mask(mask, dtype), "sliding_attention": sliding}


def run_text_model(text_model, embeds: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                   slots: torch.Tensor, mask: torch.Tensor, attention_backend: str | None = None,
                   window: int | None = None, seq_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The transformers text model `text_model` (its own forward) over input embeddings [B, S, H] at positions
    ([B, S], or the model's own layout such as M-RoPE's [3, B, S]), keys/values written at slots [B, S], mask
    [B, S, T] bool (None: every key of the cache's visible range, `mmspec.lm.CachedLM`). `window`: the model's
    sliding attention window, applied by sequence index (`seq_positions` [B, S], default the slots;
    `sliding_window_masks`). Returns the final-norm hidden state [B, S, H] (what the LM
    head reads)."""
    b, s, _ = embeds.shape
    if positions.dim() == 2:
        positions = positions.expand(b, s)
    kwargs = {}
    if attention_backend is not None:
        register_mmspec_attention()
        kwargs["mmspec_backend"] = attention_backend
    kwargs[cache_argument(text_model)] = SlotCache(cache, slots)
    if mask is None:  # every query sees every key of [0, T): the additive mask of an all-True mask, without building it
        check(window is None, "a sliding-window model needs the step's mask.")
        attention = zero_mask(b, s, cache.num_keys, embeds.dtype, embeds.device)
    elif window is None:
        attention = additive_mask(mask, embeds.dtype)
    else:
        seq_positions = (slots if seq_positions is None else seq_positions).expand(b, s).to(mask.device)  # [B, S]
        attention = sliding_window_masks(text_model.config, mask, slots.expand(b, s), seq_positions, window,
                                         embeds.dtype)
    with attention_implementation(text_model.config, MMSPEC_ATTENTION if attention_backend else None):
        out = text_model(inputs_embeds=embeds, position_ids=positions.to(embeds.device), attention_mask=attention,
                         use_cache=True, **kwargs)
    return out.last_hidden_state
