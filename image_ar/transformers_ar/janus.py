"""transformers' `JanusForConditionalGeneration` in image-generation mode as the loop's target.

Janus generates an image as `vision_config.num_image_tokens` VQ codes after a text prompt that ends with the
image-start (BOI) token. transformers' own `generate(..., generation_mode="image")` does, per code: the text
model's last hidden state -> `model.generation_head` (logits over the VQ codes, not the LM head) -> classifier-free
guidance (`uncond + scale * (cond - uncond)` on the raw logits) -> temperature, top-k, top-p -> a code, embedded
for the next step by `generation_aligner(generation_embeddings(code))`. Its CFG batch is [cond ; uncond] where the
unconditional rows are the same prompts with every token but BOS and BOI replaced by the pad token (same
attention mask); both halves are fed the same code.

`JanusCachedLM` is that step as an `mmspec.lm.CachedLM` over mmspec's `StaticKVCache`: the model's own text model
(`mmspec.hf_cache.run_text_model`), generation embeddings and head, so one forward scores a chain, a Jacobi window
or a tree, and `janus_prefill` is the prompt prefill (the CFG pair built as transformers builds it). With them the
shared loop runs every discrete method on Janus:

    lm = JanusCachedLM(model)
    target = LMTarget(lm, SamplingParams(1.0), max_new_tokens=lm.num_image_tokens, guidance_scale=5.0,
                      prefill_fn=janus_prefill(True, janus_special_ids(model, tokenizer)))
    out = generate(target, NoDrafter(), "lossless", Prompts(ids, mask), batch_size=B, max_new_tokens=...)

Prompts are right-padded (a row's codes sit at its own length + i, as transformers' left-padded batch places them
through the attention mask's cumulative sum).

Glossary: B prompts, R = 2B rows with CFG, P prompt length, S new entries per forward, V VQ codes, H text width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from image_ar.transformers_ar.prompts import Prompts, prefill_rows
from mmspec.cache import StaticKVCache
from mmspec.errors import InputError, check
from mmspec.hf_cache import check_attention_support, run_text_model
from mmspec.lm import hidden_at


@dataclass(frozen=True)
class JanusSpecialIds:
    """The token ids the CFG rows keep (BOS, BOI) and write elsewhere (pad)."""

    bos: int
    boi: int
    pad: int


def janus_special_ids(model, tokenizer=None) -> JanusSpecialIds:
    """BOS, BOI and pad as transformers' image generation reads them: the model's generation_config (bos_token_id,
    pad_token_id, generation_kwargs["boi_token_id"]), else the tokenizer's (bos, boi_token, pad); InputError when
    one is missing."""
    gen = getattr(model, "generation_config", None)
    found = {"bos": getattr(gen, "bos_token_id", None), "pad": getattr(gen, "pad_token_id", None),
             "boi": (getattr(gen, "generation_kwargs", None) or {}).get("boi_token_id")}
    if tokenizer is not None:
        boi = getattr(tokenizer, "boi_token", None)
        found["bos"] = tokenizer.bos_token_id if found["bos"] is None else found["bos"]
        found["pad"] = tokenizer.pad_token_id if found["pad"] is None else found["pad"]
        found["boi"] = tokenizer.convert_tokens_to_ids(boi) if found["boi"] is None and boi else found["boi"]
    missing = [name for name, value in found.items() if value is None]
    if missing:
        raise InputError(f"the Janus model's generation_config (and tokenizer) give no {', '.join(missing)} token id; "
                         "set generation_config.bos_token_id / pad_token_id / generation_kwargs['boi_token_id'] as "
                         "the official folders do.")
    return JanusSpecialIds(**{k: int(v) for k, v in found.items()})


class JanusCachedLM:
    """Janus's image-token step as a `CachedLM`: tokens are VQ codes, logits [B, S, V] come from the generation
    head (float32); `last_hidden` [B, S, H] is the text model's post-norm state of the last forward."""

    def __init__(self, model, attention_backend: str | None = None) -> None:
        check(getattr(getattr(model, "config", None), "model_type", None) == "janus"
              and hasattr(model, "prepare_embeddings_for_image_generation"),
              f"expected a transformers JanusForConditionalGeneration, got {type(model).__name__}.")
        check_attention_support(model.model.language_model.config, "the Janus text model", attention_backend)
        self.model, self.backend = model, attention_backend
        self.text = model.model.language_model
        cfg = self.text_config = model.config.text_config  # what a drafter is shaped after
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = model.config.vq_config.num_embeddings
        self.num_image_tokens = model.model.vision_model.config.num_image_tokens  # what generate reads
        self.last_hidden: torch.Tensor | None = None
        self.prompt_lengths: torch.Tensor | None = None  # [R] each row's prompt length in the last prefill

    @property
    def device(self) -> torch.device:
        return self.model.model.generation_head.vision_head.weight.device

    @property
    def config(self):
        return self.model.config

    def parameters(self):
        """The model's parameters (what `mmspec.profiling` keys its timings by)."""
        return self.model.parameters()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.generation_head.vision_head.weight.dtype

    def new_cache(self, batch_size: int, capacity: int) -> StaticKVCache:
        return StaticKVCache(self.num_layers, batch_size, self.num_kv_heads, capacity, self.head_dim, self.dtype,
                             self.device)

    def code_embeddings(self) -> torch.Tensor:
        """[V, H] what the text model reads for each code: generation_aligner(generation_embeddings(v))."""
        codes = torch.arange(self.vocab_size, device=self.device)
        with torch.no_grad():
            return self.model.prepare_embeddings_for_image_generation(codes)

    @torch.no_grad()
    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor,
                       mask: torch.Tensor, head_at: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings x [B, S, H] at positions [B, S]; K/V at slots [B, S]; mask [B, S, T] -> logits over
        the VQ codes [B, S, V] float32."""
        self.last_hidden = run_text_model(self.text, x, positions, cache, slots, mask, self.backend)  # [B, S, H]
        return self.head(hidden_at(self.last_hidden, head_at))  # ([B, 1, V] at one position per row `head_at`)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Codes [B, S] -> what the text model reads for them [B, S, H]: generation_aligner(generation_embeddings)."""
        return self.model.prepare_embeddings_for_image_generation(tokens.to(self.device))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden states [..., H] -> logits over the VQ codes [..., V] float32 (the generation head)."""
        head = self.model.model.generation_head
        return head(hidden.to(head.vision_head.weight.dtype)).float()

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Codes, positions, slots [B, S]; mask [B, S, T] -> logits [B, S, V]."""
        return self.forward_embeds(self.embed_tokens(tokens), positions, cache, slots, mask)


def unconditional_ids(input_ids: torch.Tensor, special: JanusSpecialIds) -> torch.Tensor:
    """[B, P] -> the CFG rows' ids: every token but BOS and BOI replaced by pad (transformers' Janus generate)."""
    keep = (input_ids == special.bos) | (input_ids == special.boi)
    return input_ids.masked_fill(~keep, special.pad)


def janus_prefill(guided: bool, special: JanusSpecialIds):
    """`LMTarget`'s prefill for `Prompts`: the prompts (and, guided, their unconditional rows as the second
    half of the batch) embedded by the text embeddings, run causally, each row's own length committed; returns
    (cache, logits over the codes for each row's first image token [R, 1, V])."""

    def prefill(model: JanusCachedLM, prompts: Prompts, extra_capacity: int):
        check(isinstance(prompts, Prompts), f"Janus targets take Prompts, got {type(prompts).__name__}.")
        rows = [prompts]
        if guided:  # the same lengths and mask, every token but BOS / BOI replaced by pad
            rows.append(Prompts(unconditional_ids(prompts.input_ids, special), prompts.attention_mask))
        return prefill_rows(model, rows, extra_capacity)

    return prefill
