"""Load official MAR checkpoints (`checkpoint-last.pth` of LTH14/mar) into `MARModel`.

The official file is a `torch.save`d dict: `'model'` (the state dict), `'model_ema'` (a state dict with the same
keys holding the EMA weights, or None when training kept no EMA), `'optimizer'`, `'epoch'`, `'scaler'` and `'args'`
(the training `argparse.Namespace`). `MARModel` keeps the official parameter names, so conversion is the identity
on keys; the converter
1. reads the file safely (`mmspec.checkpoints.load_checkpoint`: `weights_only` with the allow-list, which
   includes `argparse.Namespace`; any other object is refused unless `allow_pickle=True`);
2. takes `'model_ema'` (default, the weights the official sampler uses) or `'model'` (`weights="model"`); a raw
   state dict is also accepted; `module.` / `_orig_mod.` prefixes are stripped;
3. infers the config, every keyword the caller passes winning:
   - from the tensors: `embed_dim` and `num_classes` from `class_emb.weight` [classes, E]; the token channels
     from `z_proj.weight` [E, C]; `encoder_depth` / `decoder_depth` = 1 + the largest block index;
     `decoder_embed_dim` from `decoder_embed.weight`; `mlp_ratio` from `encoder_blocks.0.mlp.fc1.weight`;
     `diffloss_w` from `diffloss.net.input_proj.weight`, `diffloss_d` = number of `diffloss.net.res_blocks`;
     the token count L from `diffusion_pos_embed_learned` [1, L, D] and `buffer_size` = positions of
     `encoder_pos_embed_learned` - L;
   - from `args` when present: `img_size`, `vae_stride`, `patch_size`, `vae_embed_dim`, `num_sampling_steps`
     (the official string "100" becomes 100) and the training-only settings (`label_drop_prob`,
     `mask_ratio_min`, `attn_dropout`, `proj_dropout`, `diffusion_batch_mul`); otherwise the official values
     (stride 16, patch 1, 16 latent channels) and img_size = sqrt(L) x stride x patch;
   - heads (not in the weights): `args.model` (`mar_base` 12, `mar_large` 16, `mar_huge` 16), else the official
     size of that width (768 -> 12, 1024 -> 16, 1280 -> 16), else the caller must pass `num_heads=`
     (`decoder_num_heads=` likewise when the decoder is wider or narrower than the encoder);
   - `default_guidance_scale`: the paper's evaluation cfg of the official size (base 2.9, large 3.0, huge 3.2; the
     training `args.cfg` is not it), else 3.0; `default_cfg_schedule` "linear";
4. builds the model with its parameters on the meta device (no random initialisation of the ~1B parameters of
   MAR-H) and loads with `mmspec.checkpoints.load_into` (keys and shapes checked, one `CheckpointError`
   listing every problem).

    model = load_mar_checkpoint("pretrained_models/mar/mar_base/checkpoint-last.pth")   # EMA weights, eval mode
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn

from continuous.mar.model import MARModel
from mmspec.checkpoints import load_checkpoint, load_into
from mmspec.checkpoints.keys import describe_top_level, is_state_dict, strip_wrapper_prefixes
from mmspec.errors import CheckpointError, InputError, check_float_dtype

WEIGHTS = {"ema": "model_ema", "model": "model"}
# the official sizes: args.model -> (width, encoder/decoder heads); widths -> heads
OFFICIAL_MODELS = {"mar_base": (768, 12), "mar_large": (1024, 16), "mar_huge": (1280, 16)}
OFFICIAL_HEADS = {width: heads for width, heads in OFFICIAL_MODELS.values()}
OFFICIAL_EVAL_CFG = {"mar_base": 2.9, "mar_large": 3.0, "mar_huge": 3.2}  # the paper's FID setting per size
OFFICIAL_DEFAULTS = {"vae_stride": 16, "patch_size": 1, "vae_embed_dim": 16}
# official `args` attributes that are MARModel arguments of the same name
ARGS_FIELDS = ("img_size", "vae_stride", "patch_size", "vae_embed_dim", "num_sampling_steps", "label_drop_prob",
               "mask_ratio_min", "attn_dropout", "proj_dropout", "diffusion_batch_mul")


def _config_names() -> set[str]:
    return {n for n in inspect.signature(MARModel.__init__).parameters if n != "self"}


def _tensor(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"not a MAR checkpoint: {key!r} is missing (found e.g. {', '.join(list(sd)[:5])}).")
    return sd[key]


def _depth(sd: Mapping[str, torch.Tensor], prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    found = [int(m.group(1)) for k in sd if (m := pattern.match(k))]
    if not found:
        raise CheckpointError(f"not a MAR checkpoint: no `{prefix}.{{i}}` weights.")
    return 1 + max(found)


def _args_dict(args: object) -> dict[str, Any]:
    if args is None:
        return {}
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, Mapping):
        return dict(args)
    raise InputError(f"args must be an argparse.Namespace or a dict, got {type(args).__name__}.")


def _as_int(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"the checkpoint's args.{name} is {value!r}, not an integer; pass {name}=.") from None


def _heads(width: int, model_name: str | None, argument: str) -> int:
    """Heads of an official model: by its args.model name, else by its width; else the caller must say."""
    if model_name in OFFICIAL_MODELS and OFFICIAL_MODELS[model_name][0] == width:
        return OFFICIAL_MODELS[model_name][1]
    if width in OFFICIAL_HEADS:
        return OFFICIAL_HEADS[width]
    sizes = ", ".join(f"{w}: {h}" for w, h in OFFICIAL_HEADS.items())
    raise InputError(f"attention heads are not stored in the weights, and width {width} is not an official MAR "
                     f"width (width: heads {sizes}); pass {argument}=... (the number the model was trained with).")


def infer_mar_config(sd: Mapping[str, torch.Tensor], args: object = None, **known: Any) -> dict[str, Any]:
    """MARModel arguments from an official state dict and its training `args` (see the module docstring);
    `known` wins."""
    unknown = sorted(set(known) - _config_names())
    if unknown:
        raise InputError(f"unknown MARModel argument(s) {unknown}; valid ones: {sorted(_config_names())}.")
    a = _args_dict(args)
    classes, width = _tensor(sd, "class_emb.weight").shape
    token_channels = _tensor(sd, "z_proj.weight").shape[1]
    dec_width = _tensor(sd, "decoder_embed.weight").shape[0]
    seq_len = _tensor(sd, "diffusion_pos_embed_learned").shape[1]
    positions = _tensor(sd, "encoder_pos_embed_learned").shape[1]
    cfg: dict[str, Any] = {
        "embed_dim": width, "num_classes": classes, "decoder_embed_dim": dec_width,
        "encoder_depth": _depth(sd, "encoder_blocks"), "decoder_depth": _depth(sd, "decoder_blocks"),
        "mlp_ratio": _tensor(sd, "encoder_blocks.0.mlp.fc1.weight").shape[0] / width,
        "diffloss_w": _tensor(sd, "diffloss.net.input_proj.weight").shape[0],
        "diffloss_d": _depth(sd, "diffloss.net.res_blocks"), "buffer_size": positions - seq_len,
    }
    cfg.update({name: a[name] for name in ARGS_FIELDS if a.get(name) is not None})
    if "num_sampling_steps" in cfg:
        cfg["num_sampling_steps"] = _as_int("num_sampling_steps", cfg["num_sampling_steps"])
    if a.get("class_num") is not None and int(a["class_num"]) != classes:
        raise CheckpointError(f"the checkpoint's args.class_num {a['class_num']} differs from the {classes} rows of "
                              "class_emb.weight; the file is inconsistent.")
    cfg.update(known)
    cfg = {**OFFICIAL_DEFAULTS, **cfg}
    if "patch_size" not in known and a.get("patch_size") is None:  # from C = vae_embed_dim x p^2 when it fits
        p = math.isqrt(max(token_channels // cfg["vae_embed_dim"], 1))
        if cfg["vae_embed_dim"] * p * p == token_channels:
            cfg["patch_size"] = p
    if cfg["vae_embed_dim"] * cfg["patch_size"] ** 2 != token_channels:
        raise InputError(f"the checkpoint's tokens have {token_channels} channels (z_proj.weight), but vae_embed_dim "
                         f"{cfg['vae_embed_dim']} x patch_size {cfg['patch_size']}^2 = "
                         f"{cfg['vae_embed_dim'] * cfg['patch_size'] ** 2}; pass vae_embed_dim= and patch_size=.")
    side = math.isqrt(seq_len)
    if side * side != seq_len:
        raise CheckpointError(f"diffusion_pos_embed_learned has {seq_len} positions, not a square token grid.")
    cfg.setdefault("img_size", side * cfg["vae_stride"] * cfg["patch_size"])
    grid = cfg["img_size"] // (cfg["vae_stride"] * cfg["patch_size"])
    if cfg["img_size"] % (cfg["vae_stride"] * cfg["patch_size"]) or grid * grid != seq_len:
        raise InputError(f"img_size {cfg['img_size']} / (vae_stride {cfg['vae_stride']} x patch_size "
                         f"{cfg['patch_size']}) does not give the checkpoint's {side} x {side} token grid; pass "
                         "matching img_size=, vae_stride=, patch_size=.")
    model_name = a.get("model")
    if cfg.get("num_heads") is None:
        cfg["num_heads"] = _heads(width, model_name, "num_heads")
    if cfg.get("decoder_num_heads") is None and dec_width != width:
        cfg["decoder_num_heads"] = _heads(dec_width, model_name, "decoder_num_heads")
    official = model_name if model_name in OFFICIAL_EVAL_CFG else next(
        (name for name, (w, _) in OFFICIAL_MODELS.items() if w == width), None)
    if official is not None:
        cfg.setdefault("default_guidance_scale", OFFICIAL_EVAL_CFG[official])
    for name, w in (("num_heads", width), ("decoder_num_heads", dec_width)):
        heads = cfg.get(name)
        if heads is not None and w % heads:
            raise InputError(f"{name}={heads} does not divide the width {w}.")
    return cfg


def select_weights(obj: object, weights: str = "ema", path: object = "the checkpoint") -> tuple[dict, object]:
    """The state dict to load from a loaded official file (`weights`: "ema" or "model") and its `args`
    (None when absent). A raw state dict is returned as is."""
    if weights not in WEIGHTS:
        raise InputError(f"weights must be one of {sorted(WEIGHTS)}, got {weights!r}.")
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a MAR checkpoint dict.")
    if is_state_dict(obj):
        return strip_wrapper_prefixes(obj), None
    key = WEIGHTS[weights]
    sd = obj.get(key)
    if sd is None and key == "model_ema" and is_state_dict(obj.get("model")):
        raise CheckpointError(f"{path} has no EMA weights ('model_ema' is absent or None: training kept no EMA); "
                              "pass weights='model' (`--weights model`) to use the raw weights.")
    if not is_state_dict(sd):
        raise CheckpointError(f"{path} has no state dict under {key!r}, so it is not an official MAR "
                              f"checkpoint-last.pth. {describe_top_level(obj)}")
    return strip_wrapper_prefixes(sd), obj.get("args")


def load_mar_checkpoint(path: str | os.PathLike[str], *, weights: str = "ema", allow_pickle: bool = False,
                        dtype: torch.dtype = torch.float32, **config_overrides: Any) -> MARModel:
    """Build a `MARModel` from an official `checkpoint-last.pth`, in eval mode, in `dtype` on the CPU.

    weights: "ema" (the official sampler's, default) or "model"; allow_pickle: load with full pickle (runs code
    from the file: trusted files only); config_overrides: MARModel arguments that win over the inferred ones."""
    check_float_dtype(dtype)
    if weights not in WEIGHTS:
        raise InputError(f"weights must be one of {sorted(WEIGHTS)}, got {weights!r}.")
    obj = load_checkpoint(path, allow_pickle=allow_pickle)
    sd, args = select_weights(obj, weights, path)
    cfg = infer_mar_config(sd, args, **config_overrides)
    with init_empty_weights():  # parameters on the meta device; buffers and the diffusion tables are real
        model = MARModel(**cfg)
    load_into(model, sd, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"Checkpoint {path} left these tensors unloaded: {', '.join(left)}.")
    return nn.Module.to(model, dtype=dtype).eval()
