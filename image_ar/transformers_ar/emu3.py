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
the layout as an `mmspec.lm.TokenLayout` over generated-token indices; the prompt prefill with the unconditional rows
as transformers builds them is `image_ar.transformers_ar.prompts.guided_prefill`.

Glossary: B prompts, R = 2B rows with CFG, P prompt length, V the whole vocabulary, H x W the image's token grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from image_ar.transformers_ar.cached_lm import WholeVocabularyLM
from mmspec.errors import InputError, check
from mmspec.lm import TokenLayout

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


class Emu3CachedLM(WholeVocabularyLM):
    """Emu3's language model as a `CachedLM` over its whole vocabulary: logits [B, S, V] float32 from its LM head."""

    def __init__(self, model, attention_backend: str | None = None) -> None:
        check(getattr(getattr(model, "config", None), "model_type", None) == "emu3" and hasattr(model, "lm_head"),
              f"expected a transformers Emu3ForConditionalGeneration, got {type(model).__name__}.")
        super().__init__(model, model.model.text_model, model.config.text_config, "the Emu3 text model",
                         attention_backend)
