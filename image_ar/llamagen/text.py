"""The text side of text-to-image LlamaGen: caption strings -> the caption features and mask the t2i GPT reads,
as the official sampling script computes them (`language/t5.py` `T5Embedder` + `sample_t2i.py`).

    captions --clean_caption (twice)--> tokenizer(max_length=L, padding="max_length", truncation, EOS added)
             --T5 encoder--> last_hidden_state [B, L, D], mask [B, L] (right-padded)
             --left_pad_captions--> valid tokens moved to the end, mask flipped, padding slots zeroed

(`tokenize_captions`, then `caption_condition` = the encoder + `left_pad_captions`.)

L is the GPT's cls_token_num (120 for the official models, flan-t5-xl features, D = 2048). Without cleaning the
official embedder lower-cases and strips instead. The CFG null rows are the model's learned `uncond_embedding`
under the caption's own mask (`condition_prefill`); a negative prompt (not in the official code) replaces them with
its own features and mask.

`clean_caption` is the caption cleaning every T5-conditioned model since DeepFloyd IF uses (ftfy, BeautifulSoup and
a fixed list of regular expressions: urls, html, nicknames, CJK ranges, dashes and quotes, ids, file names, bad
punctuation, shipping spam); `CLEAN_STEPS` lists them in the order they run, as LlamaGen's copy has them (its
`basic_clean` strips the text in the middle, which diffusers' copy of the function does not).
"""

from __future__ import annotations

import html
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

import torch

from mmspec.errors import InputError, check

URL_TAIL = r"[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b\/?(?!@)))"
DASHES = (r"[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40\u301C\u3030\u30A0\uFE31"
          r"\uFE32\uFE58\uFE63\uFF0D]+")
BAD_PUNCT = r"[#®•©™&@·º½¾¿¡§~\)\(\]\[\}\{\|\\/\*]{1,}"
CJK_RANGES = ("\u31c0-\u31ef", "\u31f0-\u31ff", "\u3200-\u32ff", "\u3300-\u33ff", "\u3400-\u4dbf", "\u4dc0-\u4dff",
              "\u4e00-\u9fff")

# (pattern, replacement), in order; "HTML" and "BASIC" mark the BeautifulSoup and ftfy steps, "SEPARATORS" the
# dash / underscore rule (replaced by spaces only when there are more than three)
CLEAN_STEPS: list[tuple[str, str]] = [
    ("<person>", "person"),
    (r"\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|" + URL_TAIL, ""),
    (r"\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|" + URL_TAIL, ""),
    ("HTML", ""),
    (r"@[\w\d]+\b", ""),
    *[(f"[{r}]+", "") for r in CJK_RANGES],
    (DASHES, "-"),
    (r"[`´«»“”¨]", '"'),
    (r"[‘’]", "'"),
    (r"&quot;?", ""),
    (r"&amp", ""),
    (r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " "),  # ip addresses
    (r"\d:\d\d\s+$", ""),  # article ids
    (r"\\n", " "),
    (r"#\d{1,3}\b", ""),
    (r"#\d{5,}\b", ""),
    (r"\b\d{6,}\b", ""),
    (r"[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)", ""),  # file names
    (r"[\"\']{2,}", '"'),
    (r"[\.]{2,}", " "),
    (BAD_PUNCT, " "),
    (r"\s+\.\s+", " "),
    ("SEPARATORS", " "),
    ("BASIC", ""),
    (r"\b[a-zA-Z]{1,3}\d{3,15}\b", ""),
    (r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", ""),
    (r"\b\d+[a-zA-Z]+\d+\b", ""),
    (r"(worldwide\s+)?(free\s+)?shipping", ""),
    (r"(free\s)?download(\sfree)?", ""),
    (r"\bclick\b\s(?:for|on)\s\w+", ""),
    (r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?", ""),
    (r"\bpage\s+\d+\b", ""),
    (r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", " "),
    (r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", ""),
    (r"\b\s+\:\s+", ": "),
    (r"(\D[,\./])\b", r"\1 "),
    (r"\s+", " "),
    (r"^[\"\']([\w\W]+)[\"\']$", r"\1"),
    (r"^[\'\_,\-\:;]", ""),
    (r"[\'\_,\-\:\-\+]$", ""),
    (r"^\.\S+$", ""),
]
SEPARATOR = re.compile(r"(?:\-|\_)")


def caption_cleaning_modules() -> tuple[Any, Any]:
    """(ftfy, bs4.BeautifulSoup); InputError naming the install if they are missing."""
    try:
        import ftfy
        from bs4 import BeautifulSoup
    except ImportError:
        raise InputError("caption cleaning (the official t2i preprocessing) needs ftfy and beautifulsoup4: pip "
                         "install ftfy beautifulsoup4, or build the pipeline with clean_caption=False.") from None
    return ftfy, BeautifulSoup


def clean_caption(caption: str) -> str:
    """One pass of the official caption cleaning (the embedder runs it twice; see the module docstring)."""
    ftfy, soup = caption_cleaning_modules()
    caption = urllib.parse.unquote_plus(str(caption)).strip().lower()
    for pattern, replacement in CLEAN_STEPS:
        if pattern == "HTML":
            caption = soup(caption, features="html.parser").text
        elif pattern == "BASIC":
            caption = html.unescape(html.unescape(ftfy.fix_text(caption))).strip()
        elif pattern == "SEPARATORS":
            if len(SEPARATOR.findall(caption)) > 3:
                caption = SEPARATOR.sub(replacement, caption)
        else:
            caption = re.sub(pattern, replacement, caption)
    return caption.strip()


def preprocess_caption(caption: str, clean: bool) -> str:
    """The official embedder's `text_preprocessing`: clean_caption twice, or lower-case and strip."""
    return clean_caption(clean_caption(caption)) if clean else caption.lower().strip()


def check_prompts(prompt: str | Sequence[str], name: str = "prompt") -> list[str]:
    """One caption or a list of them -> list[str]; InputError for anything else or an empty list."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    check(isinstance(prompts, (list, tuple)) and len(prompts) > 0 and all(isinstance(p, str) for p in prompts),
          f"{name} must be a string or a non-empty list of strings, got {prompt!r}.")
    return list(prompts)


def tokenize_captions(tokenizer: Any, captions: Sequence[str], max_length: int,
                      clean: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Captions -> (ids [B, L], mask [B, L] long, 1 = token), right-padded, as `T5Embedder.get_text_embeddings`
    tokenizes them: preprocessing, padded / truncated to L with the tokenizer's special tokens (T5: EOS)."""
    texts = [preprocess_caption(c, clean) for c in captions]
    tokens = tokenizer(texts, max_length=max_length, padding="max_length", truncation=True,
                       return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
    return tokens["input_ids"], tokens["attention_mask"]


def caption_condition(text_encoder: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenized captions (ids [B, L], mask [B, L], right-padded, as the tokenizer gives them) -> the GPT's condition:
    left-padded features [B, L, D] and mask [B, L] bool (grad flows when enabled: training the encoder)."""
    hidden = text_encoder(input_ids=ids.long(), attention_mask=mask.long())["last_hidden_state"]  # [B, L, D]
    return left_pad_captions(hidden, mask.long())


def left_pad_captions(features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (features [B, L, D], mask [B, L]) -> left-padded ones as `sample_t2i.py` makes them: each
    row's n valid tokens moved to the last n slots (the pad features rotated to the front), the mask flipped,
    then every padding slot's features zeroed (`emb * mask`). Returns (features [B, L, D], mask [B, L] bool)."""
    length = mask.shape[1]
    valid = mask.sum(1)  # [B]
    source = (torch.arange(length, device=mask.device) + valid.unsqueeze(1)) % length  # [B, L]: the rotation
    rotated = features.gather(1, source.unsqueeze(-1).expand(-1, -1, features.shape[-1]))  # [B, L, D]
    flipped = mask.flip(-1)  # [B, L]
    return rotated * flipped.unsqueeze(-1).to(rotated.dtype), flipped.bool()
