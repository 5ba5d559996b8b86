"""Load official LlamaGen GPT checkpoints (`c2i_*.pt`, `t2i_*.pt`, FSDP `consolidated.pth`) into `LlamaGenGPT`.

The official module names are kept by `LlamaGenGPT`, so conversion is the identity on keys. What the converter
does:

1. reads the file safely with `mmspec.checkpoints.load_state_dict` (`weights_only`; the training `'args'`
   Namespace is allow-listed) and unwraps the container the way the official sampling scripts do: `'model'`,
   then `'module'` (DeepSpeed), then `'state_dict'`, else a raw state dict (FSDP `consolidated.pth`);
   `prefer='ema'` picks the EMA weights of a training checkpoint instead. `module.` / `_orig_mod.` prefixes
   are stripped;
2. infers the config (`infer_llamagen_config`) unless given;
3. drops what is not a weight of the architecture: `freqs_cis` (a plain attribute officially; stored only by
   old versions), KV-cache buffers (`layers.*.attention.kv_cache.{k,v}_cache`, present if a model was saved
   after `setup_caches`) and `causal_mask`; and keeps the first `cls_token_num` rows of a t2i
   `uncond_embedding` (the official `CaptionEmbedder` always allocates 120 rows and only the first
   `cls_token_num` ever reach the model);
4. loads with `mmspec.checkpoints.load_into` (keys AND shapes checked first; one `CheckpointError` listing
   every missing / unexpected key and shape mismatch), building the model on the meta device and assigning
   the checkpoint tensors, so no random initialisation and no second copy of the weights are made.

Config inference (every value passed by the caller wins; the rest comes from the file):
- `vocab_size`, `dim`: `tok_embeddings.weight` [vocab, dim].
- `n_layer`: 1 + the largest `layers.{i}` index.
- `n_head`: not visible in the weights; looked up in the official size table by (n_layer, dim)
  (B 12x768 -> 12, L 24x1024 -> 16, XL 36x1280 -> 20, XXL 48x1536 -> 24, XXXL 48x2560 -> 40, 1B 22x2048 -> 32,
  3B 24x3200 -> 32, 7B 32x4096 -> 32). Other sizes need `n_head=...`.
- `n_kv_head`: from `layers.0.attention.wqkv.weight` rows = (n_head + 2 n_kv_head) * head_dim.
- `multiple_of` / `ffn_dim_multiplier`: the settings that reproduce `layers.0.feed_forward.w1.weight` rows
  (official: 256 / None).
- `model_type`: c2i if `cls_embedding.embedding_table.weight` exists (num_classes = rows - 1: the last row is
  the null class), t2i if `cls_embedding.cap_proj.fc1.weight` exists (caption_dim = its input width,
  cls_token_num = rows of `uncond_embedding`, i.e. 120).
- `block_size`: the weights do not depend on it (2D RoPE is computed), so it comes from the file name's
  resolution with the VQ-16 tokenizer: `c2i_L_384.pt` -> (384 / 16)^2 = 576, `t2i_XL_stage2_512.pt` -> 1024.
  Without a resolution in the name it defaults to 256 (16 x 16) with a warning: pass `block_size=`.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from image_ar.llamagen.gpt import PRESETS, LlamaGenGPT, ffn_hidden_dim, preset_name_for, preset_sizes
from mmspec.checkpoints import StateDict, load_into, load_state_dict
from mmspec.errors import CheckpointError, InputError, check_float_dtype

CONTAINER_KEYS = ("model", "module", "state_dict")  # the official scripts' order
IGNORED_KEYS = (r"(^|\.)freqs_cis$", r"(^|\.)kv_cache\.[kv]_cache$", r"^causal_mask$")
VQ_DOWNSAMPLE = 16  # every released LlamaGen GPT uses the VQ-16 tokenizer
DEFAULT_BLOCK_SIZE = 256
_FILE_NAME = re.compile(r"(?P<type>c2i|t2i)_(?P<size>[A-Za-z0-9]+?)_(?:stage\d+_)?(?P<res>\d+)", re.IGNORECASE)
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def _init_arg_names() -> set[str]:
    """The argument names of `LlamaGenGPT.__init__` (its config keys)."""
    return {n for n in inspect.signature(LlamaGenGPT.__init__).parameters if n != "self"}


def parse_file_name(name: str) -> dict[str, Any]:
    """What an official file name says: {'model_type', 'preset', 'resolution'} for the parts it holds."""
    match = _FILE_NAME.search(Path(name).name)
    if not match:
        return {}
    found: dict[str, Any] = {"model_type": match["type"].lower(), "resolution": int(match["res"])}
    if match["size"].upper() in PRESETS:
        found["preset"] = match["size"].upper()
    return found


def _tensor(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        sample = ", ".join(list(sd)[:8])
        raise CheckpointError(
            f"Not a LlamaGen GPT checkpoint: it has no {key!r} (first keys: {sample}, ... {len(sd)} in all). "
            "Pass the GPT file (c2i_*.pt / t2i_*.pt / consolidated.pth), not the VQ tokenizer."
        )
    return sd[key]


def _infer_n_layer(sd: Mapping[str, torch.Tensor]) -> int:
    indices = {int(m.group(1)) for k in sd if (m := _LAYER_KEY.match(k))}
    if not indices:
        raise CheckpointError("Not a LlamaGen GPT checkpoint: no 'layers.{i}.*' keys.")
    return max(indices) + 1


def _infer_n_head(n_layer: int, dim: int) -> int:
    name = preset_name_for(n_layer, dim)
    if name is None:
        sizes = ", ".join(f"{k} {v[0]}x{v[2]}" for k, v in PRESETS.items())
        raise CheckpointError(
            f"Cannot infer n_head: n_layer={n_layer}, dim={dim} is not an official size ({sizes}). "
            "Pass n_head=... (and any other non-default setting) to load_llamagen_gpt."
        )
    return PRESETS[name][1]


def _infer_n_kv_head(sd: Mapping[str, torch.Tensor], dim: int, n_head: int) -> int | None:
    """n_kv_head from the fused qkv rows; None (= n_head) when it equals n_head or cannot be solved (the load
    then reports the shape mismatch)."""
    w = sd.get("layers.0.attention.wqkv.weight")
    head_dim = dim // n_head
    if w is None or w.dim() != 2 or w.shape[0] % head_dim:
        return None
    extra = w.shape[0] // head_dim - n_head
    n_kv = extra // 2
    if extra % 2 or n_kv < 1 or n_head % n_kv or n_kv == n_head:
        return None
    return n_kv


def _infer_ffn(sd: Mapping[str, torch.Tensor], dim: int) -> dict[str, Any]:
    """{'multiple_of', 'ffn_dim_multiplier'} reproducing the w1 rows; {} when the official default does (or
    when nothing does: the load then reports the shape mismatch)."""
    w = sd.get("layers.0.feed_forward.w1.weight")
    if w is None or w.dim() != 2:
        return {}
    hidden = int(w.shape[0])
    for multiple_of in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if ffn_hidden_dim(dim, multiple_of) == hidden:
            return {} if multiple_of == 256 else {"multiple_of": multiple_of}
    multiplier = hidden / int(2 * (4 * dim) / 3)
    if ffn_hidden_dim(dim, 1, multiplier) == hidden:
        return {"multiple_of": 1, "ffn_dim_multiplier": multiplier}
    return {}


def _infer_condition(sd: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    if "cls_embedding.embedding_table.weight" in sd:
        rows = int(sd["cls_embedding.embedding_table.weight"].shape[0])
        return {"model_type": "c2i", "num_classes": rows - 1, "cls_token_num": 1}
    if "cls_embedding.cap_proj.fc1.weight" in sd:
        # the official t2i sampling script's cfg-scale (sample_t2i.py --cfg-scale 7.5); c2i keeps the pipeline's 4.0
        found = {"model_type": "t2i", "caption_dim": int(sd["cls_embedding.cap_proj.fc1.weight"].shape[1]),
                 "default_guidance_scale": 7.5}
        uncond = sd.get("cls_embedding.uncond_embedding")
        found["cls_token_num"] = int(uncond.shape[0]) if uncond is not None else 120
        return found
    raise CheckpointError(
        "Cannot tell c2i from t2i: the checkpoint has neither 'cls_embedding.embedding_table.weight' (c2i) nor "
        "'cls_embedding.cap_proj.fc1.weight' (t2i)."
    )


def _infer_block_size(file_info: dict[str, Any], file_name: str | None) -> int:
    resolution = file_info.get("resolution")
    if resolution is not None and resolution % VQ_DOWNSAMPLE == 0:
        return (resolution // VQ_DOWNSAMPLE) ** 2
    warnings.warn(
        f"block_size (number of image tokens) cannot be read from the weights, and the file name {file_name!r} "
        f"gives no resolution; using {DEFAULT_BLOCK_SIZE} (256 px with the VQ-16 tokenizer). Pass block_size="
        "(resolution // 16) ** 2 if the model was trained at another resolution.",
        UserWarning,
        stacklevel=3,
    )
    return DEFAULT_BLOCK_SIZE


def infer_llamagen_config(state_dict: Mapping[str, torch.Tensor], file_name: str | None = None,
                          **known: Any) -> dict[str, Any]:
    """The `LlamaGenGPT` config of an official state dict (see the module docstring for the rules).

    `known` values are kept as given and not inferred (e.g. `n_head=`, `block_size=`); `file_name` supplies only
    the resolution (block_size).
    """
    unknown = set(known) - _init_arg_names()
    if unknown:
        raise InputError(f"unknown LlamaGenGPT config argument(s) {sorted(unknown)}; valid: "
                         f"{', '.join(sorted(_init_arg_names()))}.")
    file_info = parse_file_name(file_name) if file_name else {}
    config: dict[str, Any] = {}
    vocab, dim = (int(n) for n in _tensor(state_dict, "tok_embeddings.weight").shape)
    config["vocab_size"] = vocab
    config["dim"] = known.get("dim", dim)
    config["n_layer"] = known.get("n_layer", _infer_n_layer(state_dict))
    if "n_head" in known:
        config["n_head"] = known["n_head"]
    else:
        config["n_head"] = _infer_n_head(config["n_layer"], config["dim"])
    config["n_kv_head"] = _infer_n_kv_head(state_dict, config["dim"], config["n_head"])
    config.update(_infer_ffn(state_dict, config["dim"]))
    config.update(_infer_condition(state_dict))
    if "block_size" not in known:
        config["block_size"] = _infer_block_size(file_info, file_name)
    config.update(known)
    return config


def prepare_llamagen_state_dict(state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> StateDict:
    """The official state dict as `LlamaGenGPT` expects it: a t2i `uncond_embedding` longer than cls_token_num
    keeps its first cls_token_num rows (the only ones the official model uses). Keys are unchanged."""
    sd = dict(state_dict)
    key = "cls_embedding.uncond_embedding"
    c = config.get("cls_token_num")
    uncond = sd.get(key)
    if config.get("model_type") == "t2i" and uncond is not None and c is not None and uncond.dim() == 2:
        sd[key] = uncond[:c]  # [C, caption_dim]; a shorter tensor stays as is and fails the shape check
    return sd


def _resolve_known(config: str | Mapping[str, Any] | None, overrides: dict[str, Any]) -> dict[str, Any]:
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, str):
        n_layer, n_head, dim = preset_sizes(config)
        base = {"n_layer": n_layer, "n_head": n_head, "dim": dim}
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        raise InputError(f"config must be None, a preset name ({', '.join(PRESETS)}) or a dict of LlamaGenGPT "
                         f"arguments, got {type(config).__name__}.")
    return {**base, **overrides}


def load_llamagen_gpt(
    path: str | os.PathLike[str],
    config: str | Mapping[str, Any] | None = None,
    *,
    prefer: str | None = None,
    dtype: torch.dtype = torch.float32,
    allow_pickle: bool = False,
    **overrides: Any,
) -> LlamaGenGPT:
    """Build a `LlamaGenGPT` from an official checkpoint file, in eval mode, in `dtype` on the CPU.

    config: None (infer everything), a preset name ('B', 'L', 'XL', ... fixes n_layer, n_head, dim) or a dict of
    `LlamaGenGPT` arguments; `overrides` (e.g. `block_size=576`, `attention_backend="eager"`) win over both and
    over inference. prefer: the container key to take the weights from (e.g. 'ema'); allow_pickle: see
    `mmspec.checkpoints.load_checkpoint` (trusted files only). Raises `CheckpointError` listing every missing /
    unexpected key and shape mismatch when the file does not fit the config.
    """
    check_float_dtype(dtype)
    sd = load_state_dict(path, keys=CONTAINER_KEYS, prefer=prefer, allow_pickle=allow_pickle)
    known = _resolve_known(config, overrides)
    cfg = infer_llamagen_config(sd, Path(path).name, **known)
    sd = prepare_llamagen_state_dict(sd, cfg)
    with torch.device("meta"):
        model = LlamaGenGPT(**cfg)
    load_into(model, sd, ignore_unexpected=IGNORED_KEYS, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"Checkpoint {path} left these tensors unloaded: {', '.join(left)}.")
    # nn.Module.to: ModelMixin.to logs a spurious 'keep in float32' warning whenever a dtype is given
    return nn.Module.to(model, dtype=dtype).eval()
