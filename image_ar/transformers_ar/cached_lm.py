"""The language model and LM head of a transformers AR image generator whose vocabulary holds text and image tokens
(Emu3, Chameleon / Lumina-mGPT) as an `mmspec.lm.CachedLM`: the model's own text model run over mmspec's static KV
cache (`mmspec.hf_cache.run_text_model`) and its own LM head, unmasked.

Glossary: B rows, S new positions, T cache slots, H hidden width, V the whole vocabulary.
"""

from __future__ import annotations

import torch

from mmspec.cache import StaticKVCache
from mmspec.hf_cache import check_attention_support, run_text_model
from mmspec.lm import hidden_at


class WholeVocabularyLM:
    """A transformers model's text model `text` and its `lm_head` as a `CachedLM` over the whole vocabulary: logits
    [B, S, V] float32, nothing masked (text and image tokens share the vocabulary; a `TokenLayout` says which a
    position may hold). `cfg` is the text model's config."""

    def __init__(self, model, text, cfg, what: str, attention_backend: str | None = None) -> None:
        self.text = text
        check_attention_support(self.text.config, what, attention_backend)
        self.model, self.backend = model, attention_backend
        self.input_embeddings = model.get_input_embeddings()  # looked up once (the lookup walks the model)
        self.text_config = cfg  # what a drafter is shaped after
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.last_hidden: torch.Tensor | None = None
        self.prompt_lengths: torch.Tensor | None = None  # [R] each row's prompt length in the last prefill

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def config(self):
        return self.model.config

    def parameters(self):
        """The model's parameters (what `mmspec.profiling` keys its timings by)."""
        return self.model.parameters()

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        w = self.model.lm_head.weight
        return StaticKVCache(self.num_layers, batch_size, self.num_kv_heads, capacity, self.head_dim, w.dtype,
                             w.device)

    @torch.no_grad()
    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor,
                       mask: torch.Tensor, head_at: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings x [B, S, H] at positions [B, S]; K/V at slots; mask [B, S, T] -> logits [B, S, V]."""
        self.last_hidden = run_text_model(self.text, x, positions, cache, slots, mask, self.backend)  # [B, S, H]
        return self.head(hidden_at(self.last_hidden, head_at))  # ([B, 1, V] at one position per row `head_at`)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] -> the model's input embeddings [B, S, H]."""
        return self.input_embeddings(tokens.to(self.device))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden states [..., H] -> logits over the whole vocabulary [..., V] float32 (the LM head)."""
        return self.model.lm_head(hidden.to(self.model.lm_head.weight.dtype)).float()

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(tokens), positions, cache, slots, mask)
