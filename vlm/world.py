"""The embedded-world LLaVA target: a small LLaVA-architecture model for the world's 32x32 images, its processor,
the prompt format, and the world's question/answer data as LLaVA training and evaluation batches.

The model is a transformers `LlavaForConditionalGeneration` (CLIP vision tower, Linear-GELU-Linear projector,
Llama language model) at a small size, trained from scratch by `mmspec train vlm` (vlm/train.py). Everything is
built offline from the world tokenizer (`assets/tokenizer`); nothing is downloaded.

    config = world_llava_config()                           # ~4.3M parameters
    processor = world_processor()                            # expands <image> into 64 tokens
    examples = world_vqa_examples("train", 32, seed=0)       # images, questions, short or long answers
    batch = collate_vqa(examples, processor)                 # input_ids, attention_mask, pixel_values, labels

Prompt format (`build_prompt`), LLaVA-1.5's conversation style:
    short answer:  "USER: <image>\\n{question} ASSISTANT:"                     -> "red<eos>"
    long answer:   "USER: <image>\\n{question} Answer in detail. ASSISTANT:"   -> "The object is red. It is ...<eos>"
The world tokenizer collapses whitespace runs, so the newline after `<image>` is encoded as a plain space.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmspec.data import QA, SPLITS, generate_batch, load_world_tokenizer
from mmspec.errors import check, check_positive_int

IMAGE_SIZE = 32  # world images the target reads
PATCH_SIZE = 4  # 32 / 4 = 8 x 8 = 64 patches, one image token each (the CLS token is dropped)
LONG_INSTRUCTION = "Answer in detail."
IGNORE_INDEX = -100  # label of positions that carry no loss (prompt, image tokens, padding)

# the default sizes; `world_llava_config(vision=..., text=...)` overrides any of them
WORLD_VISION: dict = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                          image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=3)
WORLD_TEXT: dict = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0,
                        tie_word_embeddings=False)


# ---------------------------------------------------------------------------------------------- model and processor
def world_llava_config(vision: dict | None = None, text: dict | None = None, tokenizer=None, **overrides):
    """A `transformers.LlavaConfig` for 32x32 world images: CLIP vision tower (patch 4: 64 patches + CLS; layer -2's
    patch features, CLS dropped ("default") = 64 image tokens), Llama text model over the world tokenizer's
    vocabulary. `vision` / `text` override entries of WORLD_VISION / WORLD_TEXT (e.g. tiny test models);
    `overrides` go to LlavaConfig itself."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    tok = tokenizer if tokenizer is not None else load_world_tokenizer()
    for name, given, cls in (("vision", vision, CLIPVisionConfig), ("text", text, LlamaConfig)):
        check(given is None or isinstance(given, dict),
              f"{name} must be a dict of {cls.__name__} fields, got {given!r}.")
        unknown = sorted(set(given or {}) - set(cls().to_dict()))
        check(not unknown, f"{name} has no {cls.__name__} field(s) {unknown}; check the spelling.")
    vision_kw = {**WORLD_VISION, **(vision or {})}
    text_kw = {**WORLD_TEXT, **(text or {})}
    check(vision_kw["image_size"] % vision_kw["patch_size"] == 0,
          f"vision image_size {vision_kw['image_size']} must be a multiple of patch_size {vision_kw['patch_size']}.")
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision_config = CLIPVisionConfig(**vision_kw)
    text_config = LlamaConfig(vocab_size=len(tok), **ids, **text_kw)
    kwargs = dict(image_token_index=tok.convert_tokens_to_ids("<image>"),
                  image_seq_length=(vision_kw["image_size"] // vision_kw["patch_size"]) ** 2,
                  projector_hidden_act="gelu", vision_feature_select_strategy="default", vision_feature_layer=-2,
                  tie_word_embeddings=text_kw["tie_word_embeddings"], **ids)
    kwargs.update(overrides)
    return LlavaConfig(vision_config=vision_config, text_config=text_config, **kwargs)


def world_processor(tokenizer=None, image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE):
    """A `transformers.LlavaProcessor` for world images, built offline: the world tokenizer and a
    `CLIPImageProcessor` that leaves 32x32 images at 32x32 (resize to shortest edge 32 and centre-crop 32 are
    no-ops for them; other sizes are resized), rescales to [0, 1] and normalises with CLIP's mean and std, as the
    LLaVA-1.5 processors do. `<image>` in the text becomes (32 / 4)^2 + 1 - 1 = 64 image tokens (CLS dropped).
    Takes uint8 [3, H, W] tensors (or PIL images / arrays). Saves and loads with save_pretrained /
    `LlavaProcessor.from_pretrained(folder, local_files_only=True)`."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = tokenizer if tokenizer is not None else load_world_tokenizer()
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size},
                                         do_convert_rgb=False)
    return LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch_size,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def num_image_tokens(processor) -> int:
    """How many `<image>` tokens the processor puts in place of one `<image>` (64 for the world target)."""
    side = processor.image_processor.crop_size["height"] // processor.patch_size
    return side * side + processor.num_additional_image_tokens - (processor.vision_feature_select_strategy == "default")


# ----------------------------------------------------------------------------------------------------- prompts
def build_prompt(question: str, long: bool) -> str:
    """The target's prompt for `question`: the long form asks for a detailed answer (see the module docstring)."""
    suffix = f" {LONG_INSTRUCTION}" if long else ""
    return f"USER: <image>\n{question}{suffix} ASSISTANT:"


def answer_text(qa: QA, long: bool, eos: str = "<eos>") -> str:
    """The training target after the prompt: the short or long answer, then `eos`."""
    return (qa.long if long else qa.short) + eos


# -------------------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class VQAExample:
    """One world image with one question and which answer (short or long) is asked for."""

    image: torch.Tensor  # uint8 [3, 32, 32]
    qa: QA
    long: bool
    index: int  # the scene's position in its (seed, split) stream

    @property
    def prompt(self) -> str:
        return build_prompt(self.qa.question, self.long)

    @property
    def answer(self) -> str:
        """The expected answer text (no `<eos>`)."""
        return self.qa.long if self.long else self.qa.short


def world_vqa_examples(split: str, n: int, seed: int = 0, *, start: int = 0, long_fraction: float = 0.5,
                       two_objects: float = 0.4, all_questions: bool = False) -> list[VQAExample]:
    """Scenes `start .. start + n - 1` of the world stream (seed, split) as VQA examples: one question drawn per
    scene (every question of each scene with `all_questions`), each asking for the long answer with probability
    `long_fraction`. Deterministic in (seed, split, start, n)."""
    check_positive_int("n", n)
    check(0.0 <= long_fraction <= 1.0, f"long_fraction must be in [0, 1], got {long_fraction!r}.")
    batch = generate_batch(n, seed, split=split, start=start, image_size=IMAGE_SIZE, two_objects=two_objects)
    rng = np.random.default_rng([int(seed), list(SPLITS).index(split), int(start), 0x564C4D])
    out = []
    for row, pairs in enumerate(batch.qa):
        chosen = pairs if all_questions else [pairs[int(rng.integers(len(pairs)))]]
        for qa in chosen:
            out.append(VQAExample(batch.images[row], qa, bool(rng.random() < long_fraction), start + row))
    return out


def collate_vqa(examples: Sequence[VQAExample], processor, with_answers: bool = True,
                padding_side: str | None = None) -> dict[str, torch.Tensor]:
    """A model batch of `examples`: input_ids, attention_mask [B, T], pixel_values [B, 3, 32, 32] and, with
    answers, labels [B, T] (the answer's tokens and `<eos>`; -100 on the prompt, the image tokens and padding).
    Padding goes right for training (default with answers) and left for generation (default without)."""
    check(len(examples) > 0, "collate_vqa needs at least one example.")
    side = padding_side or ("right" if with_answers else "left")
    check(side in ("left", "right"), f"padding_side must be 'left' or 'right', got {side!r}.")
    tok = processor.tokenizer
    marker = image_marker(processor)
    enc = processor(images=[ex.image for ex in examples], return_tensors=None,
                    text=[ex.prompt.replace("<image>", marker) for ex in examples])
    rows, targets = [], []
    for ex, prompt_ids in zip(examples, enc["input_ids"]):
        answer_ids = (tok(answer_text(ex.qa, ex.long, tok.eos_token), add_special_tokens=False)["input_ids"]
                      if with_answers else [])
        rows.append(list(prompt_ids) + answer_ids)
        targets.append([IGNORE_INDEX] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, target) in enumerate(zip(rows, targets)):
        cols = slice(0, len(ids)) if side == "right" else slice(width - len(ids), width)
        input_ids[i, cols] = torch.tensor(ids)
        attention_mask[i, cols] = 1
        labels[i, cols] = torch.tensor(target)
    pixels = enc["pixel_values"]  # LLaVA: one [3, H, W] per image; Qwen2-VL: flattened patches
    if isinstance(pixels, list):
        pixels = np.stack(pixels) if np.asarray(pixels[0]).ndim == 3 else np.concatenate(pixels)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "pixel_values": torch.as_tensor(pixels).float()}
    if "image_grid_thw" in enc:  # Qwen2-VL: each image's patch grid, and which tokens are image tokens
        batch["image_grid_thw"] = torch.as_tensor(np.asarray(enc["image_grid_thw"])).view(-1, 3)
        batch["mm_token_type_ids"] = (input_ids == tok.convert_tokens_to_ids(processor.image_token)).long()
    if with_answers:
        batch["labels"] = labels
    return batch


def image_marker(processor) -> str:
    """What one image is in a prompt's text before `processor` expands it: its image token (`<image>` for LLaVA),
    between Qwen2-VL's `<|vision_start|>` and `<|vision_end|>` when the tokenizer has them; Gemma 3's
    begin-of-image token (its processor expands that one, whatever it calls its image token)."""
    token = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None) or "<image>"
    vocab = processor.tokenizer.get_vocab()
    bounds = ("<|vision_start|>", "<|vision_end|>")
    return f"{bounds[0]}{token}{bounds[1]}" if all(b in vocab for b in bounds) else token
