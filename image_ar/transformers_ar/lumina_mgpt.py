"""Lumina-mGPT (Alpha-VLLM/Lumina-mGPT) generating an image, as the loop's target, through transformers' Chameleon.

Lumina-mGPT is Chameleon-7B/34B fine-tuned to write images; Lumina-mGPT 2.0 is a decoder of the same architecture
trained from scratch, with a Qwen-style tokenizer and MoVQGAN codes (`image_ar.movqgan`). Their code runs its own fork
of transformers' Chameleon,
identical in the forward except that `mask_image_logits` (false in its checkpoints) turns off the masking of image
logits that transformers' `ChameleonForConditionalGeneration` always applies; so the target here is transformers'
`ChameleonModel` and `lm_head` run directly (`ChameleonCachedLM`), nothing masked.

Prompt and layout, as the official `FlexARItemProcessor` and `FlexARInferenceSolver` build them:

    [BOS] "Generate an image of {W}x{H} according to the following prompt:\\n{prompt}" <reserved08706>
    <racm3:break> <grid h> <grid w>          the image header (grid token of n = `<reserved{8800 + n:05d}>`,
                                             n = pixels / 32: the resolution in 32-pixel units, height first)
    H rows of (W image tokens, <reserved08799>)     image tokens are the VQ's codes as token ids: 1.0 H = 2h,
                                             W = 2w (VQGAN codes of 16 px), 2.0 H = 4h, W = 4w (MoVQGAN, 8 px)
    <eoss>                                   end of image (then `<reserved08706>`, the EOS, ends the answer)

The official solver lets the model write the header (a trained model writes the one its prompt asks for); the
pipeline writes it into the prompt, as Emu3's processor does with `return_for_image_generation=True`, so a call's
size is the one asked and a random test model still generates an image. Generated-token index t (t = 0 right after
the header) must be the row end when (t + 1) % (W + 1) == 0, `<eoss>` at t = H (W + 1), an image token elsewhere
(the official `MultiModalLogitsProcessor`); the call stops at `<eoss>` (2.0's EOS).

Classifier-free guidance as the official `LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor`:
the unconditional context is the image header alone (`<racm3:break> <grid h> <grid w>`, no text, at positions 0-2),
followed by the generated tokens; logits u + g (c - u) on raw logits (the loop combines log-softmaxed ones, which
differ by a constant per row: the same distribution). The official order after CFG is the layout mask, then top-k
2000 over image tokens, then temperature, which gives the distribution the loop's sampler does.

Lumina-mGPT 2.0's own CFG processor rescales a guidance scale above 4 step by step (`max(4, g (1 - t / (H W)))`,
compounding), its SJD path does not; the pipeline applies the scale given, constant (its default is 4.0, which
neither changes).

Glossary: B prompts, R = 2B rows with CFG, H x W the latent grid of codes, V the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from image_ar.transformers_ar.cached_lm import WholeVocabularyLM
from image_ar.transformers_ar.prompts import Prompts
from mmspec.errors import InputError, check
from mmspec.lm import TokenLayout

IMAGE_START, IMAGE_END = "<racm3:break>", "<eoss>"
NEW_LINE, SEPARATOR = "<reserved08799>", "<reserved08706>"  # the row end; the turn separator, also the EOS
PATCH = 32  # pixels per grid unit (the item processor's patch_size): 2 x 2 VQGAN codes (1.0), 4 x 4 MoVQGAN's (2.0)
PROMPT = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
KINDS = ("visual", "eol", "eoi", "eos")  # what a generated-token index may be, in layout order
MOVQGAN_PREFIX = "<MOVQGAN"  # Lumina-mGPT 2.0's image tokens (its `get_image_tokens`); 1.0's are Chameleon's IMGIMG*


def grid_token(units: int) -> str:
    """The token naming a side of `units` x 32 pixels (the item processor's `get_n_grids_token`)."""
    return f"<reserved{8800 + units:05d}>"


@dataclass(frozen=True)
class LuminaSpecialIds:
    """The ids of the layout tokens and of the image tokens (`image_token_codes`)."""

    image_start: int
    image_end: int
    new_line: int
    separator: int
    bos: int
    visual: tuple[int, ...]


def token_id(tokenizer, token: str) -> int:
    """The id of one token of the vocabulary; InputError (one line) when the tokenizer lacks it."""
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id:
        raise InputError(f"the tokenizer has no {token} token: a Lumina-mGPT folder needs its own tokenizer (the one "
                         "the official folder ships).")
    return int(found)


def image_token_codes(model) -> tuple[list[int], list[int]]:
    """(image token ids, their VQ codes) from the model's vocabulary map: Lumina-mGPT's Chameleon `IMGIMG*` names
    through transformers' `bpe2img`, else Lumina-mGPT 2.0's `<MOVQGAN*` names, consecutive ids of codes 0, 1, ...
    (its `get_image_token`: code + 155000). InputError (one line) when the map names neither."""
    mapping = model.model.vocabulary_mapping
    if mapping.image_tokens:
        return list(mapping.image_tokens), [mapping.bpe2img[t] for t in mapping.image_tokens]
    ids = sorted(v for k, v in (model.config.vocabulary_map or {}).items() if k.startswith(MOVQGAN_PREFIX))
    check(len(ids) > 0, "the model's vocabulary map names no image tokens (IMGIMG* or <MOVQGAN*); use the folder's "
                        "own config.json.")
    check(ids == list(range(ids[0], ids[0] + len(ids))), f"the {MOVQGAN_PREFIX}* image tokens are not consecutive "
                                                         "ids; Lumina-mGPT 2.0 numbers them code + a fixed offset.")
    return ids, [t - ids[0] for t in ids]


def lumina_special_ids(tokenizer, visual: list[int]) -> LuminaSpecialIds:
    """The layout's ids read from the tokenizer by name, with the image tokens `visual` (`image_token_codes`; the
    official code's fixed ids, 1.0: 8197, 8196, 8803, 8710 and 4..8195; 2.0: 151665, 151666, ... and 155000 + code,
    are these in each one's vocabulary). BOS is the tokenizer's, else its EOS, as the official xllmx `Tokenizer`
    (2.0's Qwen-style tokenizer has no BOS)."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    check(bos is not None, "the tokenizer has neither a BOS nor an EOS token; use the Lumina-mGPT folder's own.")
    return LuminaSpecialIds(token_id(tokenizer, IMAGE_START), token_id(tokenizer, IMAGE_END),
                            token_id(tokenizer, NEW_LINE), token_id(tokenizer, SEPARATOR), int(bos), tuple(visual))


def latent_grid(height: int, width: int, codes_per_unit: int = 2) -> tuple[int, int]:
    """Pixels -> the (H, W) grid of codes (`codes_per_unit` a 32-pixel side: 2 for 1.0's VQGAN, 4 for 2.0's
    MoVQGAN); InputError unless both are multiples of 32."""
    for name, value in (("height", height), ("width", width)):
        check(isinstance(value, int) and value >= PATCH and value % PATCH == 0,
              f"{name} must be a positive multiple of {PATCH} pixels (Lumina-mGPT's grid unit), got {value!r}.")
    return codes_per_unit * height // PATCH, codes_per_unit * width // PATCH


def layout_length(grid_h: int, grid_w: int) -> int:
    """Generated tokens of an H x W latent grid: H rows of W image tokens + the row end, then `<eoss>`."""
    return grid_h * (grid_w + 1) + 1


def lumina_layout(special: LuminaSpecialIds, grid_h: int, grid_w: int, vocab_size: int) -> TokenLayout:
    """The `TokenLayout` of the official `MultiModalLogitsProcessor` over generated-token indices: the row end at
    (t + 1) % (W + 1) == 0, `<eoss>` at t = H (W + 1), an image token elsewhere; index H (W + 1) + 1 (past the
    call's end) the EOS, which a trained model writes next."""
    n = layout_length(grid_h, grid_w)
    t = torch.arange(n + 1)
    kinds = torch.zeros(n + 1, dtype=torch.long)  # visual
    kinds[(t + 1) % (grid_w + 1) == 0] = KINDS.index("eol")
    kinds[n - 1], kinds[n] = KINDS.index("eoi"), KINDS.index("eos")
    allowed = torch.zeros(len(KINDS), vocab_size, dtype=torch.bool)
    allowed[0, list(special.visual)] = True
    for kind, token in (("eol", special.new_line), ("eoi", special.image_end), ("eos", special.separator)):
        allowed[KINDS.index(kind), token] = True
    return TokenLayout(kinds, allowed)


def image_header(special: LuminaSpecialIds, tokenizer, height: int, width: int) -> list[int]:
    """`<racm3:break> <grid h> <grid w>` of an image of height x width pixels."""
    return [special.image_start, token_id(tokenizer, grid_token(height // PATCH)),
            token_id(tokenizer, grid_token(width // PATCH))]


def encode_prompts(tokenizer, special: LuminaSpecialIds, prompts: list[str], height: int, width: int) -> Prompts:
    """Prompts -> right-padded ids: BOS, the official request text and separator (the item processor's
    conversation, tokenized without special tokens), then the image header."""
    header = image_header(special, tokenizer, height, width)
    rows = [[special.bos, *tokenizer.encode(PROMPT.format(width=width, height=height, prompt=p) + SEPARATOR,
                                            add_special_tokens=False), *header] for p in prompts]
    return token_rows(rows)


def token_rows(rows: list[list[int]]) -> Prompts:
    """Lists of ids -> right-padded `Prompts`."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return Prompts(ids, mask)


def unconditional_rows(special: LuminaSpecialIds, tokenizer, rows: int, height: int, width: int) -> Prompts:
    """The official CFG context of each row: the image header alone."""
    return token_rows([image_header(special, tokenizer, height, width)] * rows)


class ChameleonCachedLM(WholeVocabularyLM):
    """transformers' `ChameleonModel` and LM head as a `CachedLM` over the whole vocabulary, image logits unmasked
    (Lumina-mGPT's `mask_image_logits=False`): logits [B, S, V] float32."""

    def __init__(self, model, attention_backend: str | None = None) -> None:
        check(getattr(getattr(model, "config", None), "model_type", None) == "chameleon" and hasattr(model, "lm_head"),
              f"expected a transformers ChameleonForConditionalGeneration, got {type(model).__name__}.")
        super().__init__(model, model.model, model.config, "the Chameleon model", attention_backend)
