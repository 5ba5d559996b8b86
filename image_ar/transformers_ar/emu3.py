"""transformers' `Emu3ForConditionalGeneration` generating an image as the loop's target.

Emu3 generates an image with its plain language model over its whole vocabulary (text and image tokens share
it). The prompt is the processor's `return_for_image_generation=True` form: `<|image start|>{H}*{W}<|image token|>`
appended. Classifier-free guidance runs an unconditional context alongside (transformers' unbatched CFG, followed by
the generated tokens; `u + g * (c - u)` on log-softmaxed logits, which is the raw-logit combination up to a constant
per row, so the same distribution). The official generation script (baaivision/Emu3 `image_generation.py`, as SJD's
`test_emu3.py`) makes that context from a fixed negative prompt (`EMU3_NEGATIVE_PROMPT`) encoded like the prompt,
image header included (its processor's `mode='G'`), at CFG 3.0 and top-k 2048: the pipeline's default. transformers'
`generate` without `negative_prompt_ids` uses each prompt's last token instead, and its documentation's example
tokenizes a negative prompt without the header: both are options of the pipeline. A `prefix_allowed_tokens_fn` fixes
the layout: H rows of W visual tokens, each row closed by the end-of-line token `<|extra_200|>`, then end-of-frame
`<|extra_201|>`, end-of-image and EOS. The constraint runs after CFG and before temperature / top-k / top-p.
`decode_image_tokens(image_tokens=, height=, width=)` drops the last 3 tokens and the end-of-line column and decodes
the rest with the model's VQ decoder. (The official script also appends `EMU3_POSITIVE_PROMPT` to its prompt; the
pipeline leaves the user's prompt as given.)

`Emu3CachedLM` is the language model step as an `mmspec.lm.CachedLM` (its own text model and LM head), `emu3_layout`
the layout as an `mmspec.lm.TokenLayout` over generated-token indices, `emu3_prefill` the prompt prefill with the
unconditional rows as transformers builds them.

Glossary: B prompts, R = 2B rows with CFG, P prompt length, V the whole vocabulary, H x W the image's token grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from image_ar.transformers_ar.prompts import Prompts, prefill_rows
from mmspec.cache import StaticKVCache
from mmspec.errors import InputError, check
from mmspec.hf_cache import check_attention_support, run_text_model
from mmspec.lm import TokenLayout, hidden_at

EOL_TOKEN = "<|extra_200|>"  # closes each row of visual tokens (Emu3's vocabulary_map names it)
# the official generation script's unconditional context and prompt suffix (baaivision/Emu3 `image_generation.py`)
EMU3_NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, "
                        "cropped, worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, "
                        "username, blurry.")
EMU3_POSITIVE_PROMPT = " masterpiece, film grained, best quality."
KINDS = ("visual", "eol", "eof", "eoi", "eos", "pad")  # what a generated-token index may be, in layout order


@dataclass(frozen=True)
class Emu3SpecialIds:
    """The ids of the layout tokens."""

    eol: int
    eof: int
    eoi: int
    eos: int
    pad: int
    visual: tuple[int, ...]


def emu3_special_ids(model, tokenizer) -> Emu3SpecialIds:
    """The layout's ids as transformers' documented recipe reads them: end-of-line and the visual tokens from the
    model's vocabulary map, end-of-frame / end-of-image / EOS / pad from the processor's tokenizer."""
    mapping = model.model.vocabulary_mapping
    ids = {"eol": mapping.eol_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
           "eof": tokenizer.convert_tokens_to_ids(getattr(tokenizer, "eof_token", None) or "<|extra_201|>"),
           "eoi": tokenizer.convert_tokens_to_ids(getattr(tokenizer, "eoi_token", None) or "<|image end|>")}
    missing = [name for name, value in ids.items() if value is None or value == tokenizer.unk_token_id]
    if missing or not mapping.image_tokens:
        raise InputError(f"the Emu3 model's vocabulary map and tokenizer give no {', '.join(missing) or 'visual'} "
                         "token(s); use the processor saved with the model.")
    return Emu3SpecialIds(**{k: int(v) for k, v in ids.items()}, visual=tuple(mapping.image_tokens))


def layout_length(height: int, width: int) -> int:
    """Generated tokens of an H x W image: H rows of W visual tokens + end-of-line, then EOF, EOI, EOS."""
    return height * (width + 1) + 3


def emu3_layout(special: Emu3SpecialIds, height: int, width: int, vocab_size: int) -> TokenLayout:
    """The `TokenLayout` of transformers' documented `prefix_allowed_tokens_fn`: generated-token index t (its offset
    from the `<|image token|>` that ends the prompt is t + 1) is end-of-line when (t + 1) % (W + 1) == 0, EOF at
    t = H (W + 1), EOI and EOS after it, pad beyond, and a visual token everywhere else."""
    n = layout_length(height, width)
    t = torch.arange(n + 1)
    kinds = torch.zeros(n + 1, dtype=torch.long)  # visual
    kinds[(t + 1) % (width + 1) == 0] = KINDS.index("eol")
    rows_end = height * (width + 1)
    for offset, kind in enumerate(("eof", "eoi", "eos", "pad")):
        kinds[rows_end + offset] = KINDS.index(kind)
    allowed = torch.zeros(len(KINDS), vocab_size, dtype=torch.bool)
    allowed[0, list(special.visual)] = True
    for kind in KINDS[1:]:
        allowed[KINDS.index(kind), getattr(special, kind)] = True
    return TokenLayout(kinds, allowed)


class Emu3CachedLM:
    """Emu3's language model as a `CachedLM` over its whole vocabulary: logits [B, S, V] float32 from its LM head."""

    def __init__(self, model, attention_backend: str | None = None) -> None:
        check(getattr(getattr(model, "config", None), "model_type", None) == "emu3" and hasattr(model, "lm_head"),
              f"expected a transformers Emu3ForConditionalGeneration, got {type(model).__name__}.")
        self.text = model.model.text_model
        check_attention_support(self.text.config, "the Emu3 text model", attention_backend)
        self.model, self.backend = model, attention_backend
        self.input_embeddings = model.get_input_embeddings()  # looked up once (the lookup walks the model)
        cfg = model.config.text_config
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


def last_tokens(prompts: Prompts) -> Prompts:
    """Each prompt's last real token as a one-token prompt: Emu3's unconditional context without a negative prompt."""
    last = prompts.input_ids.gather(1, (prompts.lengths - 1).unsqueeze(-1))  # [B, 1]
    return Prompts(last, torch.ones_like(last))


def emu3_prefill(guided: bool, negative: Prompts | None = None):
    """`LMTarget`'s prefill for `Prompts`: the prompts and, guided, the unconditional rows (`negative`, one per
    prompt, else each prompt's last token) as the second half of the batch, each row at its own positions and
    length; returns (cache, logits for each row's first generated token [R, 1, V])."""

    def prefill(model: Emu3CachedLM, prompts: Prompts, extra_capacity: int):
        check(isinstance(prompts, Prompts), f"Emu3 targets take Prompts, got {type(prompts).__name__}.")
        rows = [prompts]
        if guided:
            rows.append(negative if negative is not None else last_tokens(prompts))
        return prefill_rows(model, rows, extra_capacity)

    return prefill
