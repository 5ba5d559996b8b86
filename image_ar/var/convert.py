"""Load official VAR transformer checkpoints (`var_d16.pth` ... `var_d36.pth`, raw state dicts) into
`VARTransformer`.

`VARTransformer` keeps the official parameter names, so conversion is the identity on keys; the converter
1. reads the file safely (`mmspec.checkpoints.load_state_dict`: `weights_only`, no pickle unless opted in) and
   strips `module.` / `_orig_mod.` prefixes;
2. drops the official buffers that are recomputed here: `attn_bias_for_masking`, `lvl_1L`,
   `blocks.*.attn.zero_k_bias`;
3. infers the config (every value passed by the caller wins): `embed_dim` and `cvae` from `word_embed.weight`
   [C, Cvae], `vocab_size` from `head.weight`, `num_classes` = rows of `class_emb.weight` - 1 (the null class),
   `depth` = 1 + the largest `blocks.{i}` index, `num_heads` from `blocks.0.attn.scale_mul_1H11` [1, H, 1, 1]
   (else VAR's rule heads = depth), `attn_l2_norm` from that parameter's presence, `shared_aln` from
   `shared_ada_lin.1.weight`, `mlp_ratio` from `blocks.0.ffn.fc1.weight`, and `patch_nums` = the official
   schedule when `pos_1LC` holds its 680 positions (else pass `patch_nums=`);
4. loads with `mmspec.checkpoints.load_into` (keys and shapes checked, one `CheckpointError` listing every
   problem), building the model on the meta device so no random initialisation is done.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from image_ar.var.transformer import VARTransformer, check_patch_nums, scale_levels
from mmspec.checkpoints import load_into, load_state_dict
from mmspec.checkpoints.keys import strip_wrapper_prefixes
from mmspec.errors import CheckpointError, InputError, check_float_dtype

OFFICIAL_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
IGNORED_KEYS = (r"^attn_bias_for_masking$", r"^lvl_1L$", r"\.attn\.zero_k_bias$")
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")


def _tensor(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"not a VAR transformer checkpoint: {key!r} is missing (found e.g. "
                              f"{', '.join(list(sd)[:5])}).")
    return sd[key]


def infer_var_config(sd: Mapping[str, torch.Tensor], **known: Any) -> dict[str, Any]:
    """VARTransformer arguments from an official state dict (see the module docstring); `known` wins."""
    c, cvae = _tensor(sd, "word_embed.weight").shape
    depths = [int(m.group(1)) for k in sd if (m := _BLOCK_KEY.match(k))]
    if not depths:
        raise CheckpointError("not a VAR transformer checkpoint: no `blocks.{i}` weights.")
    depth = 1 + max(depths)
    scale_mul = sd.get("blocks.0.attn.scale_mul_1H11")
    cfg: dict[str, Any] = {
        "vocab_size": _tensor(sd, "head.weight").shape[0], "cvae": cvae, "embed_dim": c, "depth": depth,
        "num_classes": _tensor(sd, "class_emb.weight").shape[0] - 1,
        "num_heads": scale_mul.shape[1] if scale_mul is not None else depth,
        "attn_l2_norm": scale_mul is not None, "shared_aln": "shared_ada_lin.1.weight" in sd,
        "mlp_ratio": _tensor(sd, "blocks.0.ffn.fc1.weight").shape[0] / c,
    }
    positions = _tensor(sd, "pos_1LC").shape[1]
    if "patch_nums" not in known:
        if positions != sum(p * p for p in OFFICIAL_PATCH_NUMS):
            raise InputError(f"this checkpoint has {positions} token positions, not the official schedule's 680; "
                             "pass patch_nums=(...) with sum of squares equal to that.")
        cfg["patch_nums"] = OFFICIAL_PATCH_NUMS
    cfg.update(known)
    pns = check_patch_nums(cfg["patch_nums"])
    if sum(p * p for p in pns) != positions:
        raise InputError(f"patch_nums {pns} give {sum(p * p for p in pns)} positions, the checkpoint has {positions}.")
    return cfg


def load_var_transformer(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
                         allow_pickle: bool = False, **overrides: Any) -> VARTransformer:
    """Build a `VARTransformer` from an official `var_d*.pth`, in eval mode, in `dtype` on the CPU."""
    check_float_dtype(dtype)
    sd = strip_wrapper_prefixes(load_state_dict(path, allow_pickle=allow_pickle))
    cfg = infer_var_config(sd, **overrides)
    with torch.device("meta"):
        model = VARTransformer(**cfg)
    load_into(model, sd, ignore_unexpected=IGNORED_KEYS, assign=True)
    model.levels = scale_levels(model.patch_nums)  # a computed buffer, not in the file
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"Checkpoint {path} left these tensors unloaded: {', '.join(left)}.")
    return nn.Module.to(model, dtype=dtype).eval()
