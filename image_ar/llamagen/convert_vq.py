"""Load official LlamaGen VQ checkpoints (`vq_ds16_c2i.pt`, `vq_ds16_t2i.pt`, `vq_ds8_c2i.pt`) into `LlamaGenVQ`.

The official files are `torch.save({'model': state_dict}, ...)`; the tokenizer's training script saves
`{'model', 'optimizer', 'discriminator', 'optimizer_disc', 'steps', 'args'[, 'ema']}` and its demo/reconstruction
scripts read 'ema', else 'model', else 'state_dict'. `load_llamagen_vq` unwraps the same keys in the same order
(or a raw state dict, or a safetensors file), reads the file with `weights_only=True` (`mmspec.checkpoints`), needs
no key renaming (the module tree of `LlamaGenVQ` reproduces the official keys), infers the config from the weight
shapes unless one is given, and loads strictly with `mmspec.checkpoints.load_into`: any missing, unexpected or
mis-shaped tensor raises one `CheckpointError` that lists them all.

    vq = load_llamagen_vq("vq_ds16_c2i.pt")                    # config inferred from the shapes
    vq = load_llamagen_vq("vq_ds8_c2i.pt", config="vq_8")      # or a preset / dict, checked against the file
    python -m image_ar.llamagen.convert_vq vq_ds16_c2i.pt out/vq16   # -> diffusers save_pretrained folder
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from image_ar.llamagen.vq import PRESETS, LlamaGenVQ
from mmspec.checkpoints import LoadReport, load_into, load_state_dict
from mmspec.errors import CheckpointError, InputError

__all__ = [
    "CONTAINER_KEYS",
    "KNOWN_CHECKPOINTS",
    "convert_llamagen_vq",
    "infer_llamagen_vq_config",
    "load_llamagen_vq",
    "load_weights",
    "main",
]

# Container keys in the order the official vq_demo.py / reconstruction_vq_ddp.py try them.
CONTAINER_KEYS = ("ema", "model", "state_dict")
# Released tokenizer files and their preset (all have a 16384 x 8 codebook).
KNOWN_CHECKPOINTS = {"vq_ds16_c2i": "vq_16", "vq_ds16_t2i": "vq_16", "vq_ds8_c2i": "vq_8"}
OFFICIAL_NORM_GROUPS = 32
# Keys that may sit next to the VQ weights in a merged training dict and are never part of the tokenizer.
TRAINING_ONLY_KEYS = (r"^discriminator\.", r"^perceptual_loss\.")
USAGE_KEY = "quantize.codebook_used"
_REQUIRED = ("encoder.conv_in.weight", "encoder.conv_out.weight", "decoder.conv_out.weight",
             "quantize.embedding.weight")


def load_llamagen_vq(
    path: str | os.PathLike[str],
    config: str | Mapping[str, Any] | None = None,
    *,
    allow_pickle: bool = False,
    prefer: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    **overrides: Any,
) -> LlamaGenVQ:
    """Build a `LlamaGenVQ` from an official (or compatible) checkpoint and load its weights; eval mode.

    config: None infers it from the weight shapes (`infer_llamagen_vq_config`); 'vq_16' / 'vq_8' use the preset;
    a dict gives the full config (e.g. a saved config.json). `overrides` (any `LlamaGenVQ` config field) apply on
    top; settings that shapes cannot tell (commit_loss_beta, entropy_loss_ratio, dropout_p, codebook_l2_norm,
    norm_num_groups) keep the official values unless overridden. `prefer` picks a container key ('model' to skip
    an 'ema' entry), `allow_pickle=True` reads non-weights-only pickles (trusted files only).
    """
    sd = load_state_dict(path, allow_pickle=allow_pickle, keys=CONTAINER_KEYS, prefer=prefer)
    if config is None:
        kwargs = infer_llamagen_vq_config(sd)
        _check_file_name(path, kwargs)
        if "norm_num_groups" not in overrides:
            _check_official_groups(kwargs)
    elif isinstance(config, str):
        if config not in PRESETS:
            raise InputError(f"config={config!r} is not a preset; use one of {sorted(PRESETS)}, a dict, or None.")
        kwargs = dict(PRESETS[config])
    elif isinstance(config, Mapping):
        kwargs = {k: v for k, v in config.items() if not k.startswith("_")}  # drop _class_name, _diffusers_version
    else:
        raise InputError(f"config must be None, 'vq_16', 'vq_8' or a dict, got {type(config).__name__}.")
    kwargs.update(overrides)
    try:
        model = LlamaGenVQ(**kwargs)
    except TypeError as exc:  # an unknown config field
        raise InputError(f"Bad LlamaGenVQ config for {path}: {exc}. Valid fields: {_config_fields()}.") from exc
    load_weights(model, sd)
    return model.to(device=device, dtype=dtype).eval()


def load_weights(model: LlamaGenVQ, sd: Mapping[str, torch.Tensor]) -> LoadReport:
    """Strictly load an official-layout state dict into `model` (one `CheckpointError` listing every problem).

    The `quantize.codebook_used` usage buffer may be absent (it then stays zero) or present while the model has
    none (codebook_show_usage=False); training-only keys (`discriminator.*`, `perceptual_loss.*`) are skipped.
    """
    return load_into(model, sd, ignore_missing=[re.escape(USAGE_KEY) + "$"],
                     ignore_unexpected=[re.escape(USAGE_KEY) + "$", *TRAINING_ONLY_KEYS])


def infer_llamagen_vq_config(sd: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The `LlamaGenVQ` config fields that the weight shapes determine.

    codebook_size, codebook_embed_dim <- quantize.embedding.weight [V, C]; ch, in_channels <- encoder.conv_in
    [ch, in, 3, 3]; encoder_ch_mult[i] <- width of encoder.conv_blocks.{i}.res.0.conv1 / ch; decoder_ch_mult from
    decoder.conv_blocks.{k} (k = 0 is the lowest resolution, so the list is reversed); num_res_blocks <- the
    encoder's res blocks per level (the decoder must have one more); z_channels <- encoder.conv_out;
    out_channels <- decoder.conv_out; codebook_show_usage <- whether quantize.codebook_used is present.
    """
    missing = [k for k in _REQUIRED if k not in sd]
    if missing:
        sample = ", ".join(list(sd)[:8])
        raise CheckpointError(
            f"Not a LlamaGen VQ state dict: missing {missing} (first keys: {sample}). Pass the tokenizer file "
            "(vq_ds16_c2i.pt / vq_ds8_c2i.pt), not a GPT checkpoint, or pick the container entry with prefer=."
        )
    v, c = _shape(sd, "quantize.embedding.weight", 2)
    ch, in_channels = _shape(sd, "encoder.conv_in.weight", 4)[:2]
    enc_levels = _indices(sd, r"encoder\.conv_blocks\.(\d+)\.")
    dec_levels = _indices(sd, r"decoder\.conv_blocks\.(\d+)\.")
    if not enc_levels or enc_levels != dec_levels:
        raise CheckpointError(
            f"Encoder levels {enc_levels} and decoder levels {dec_levels} (conv_blocks indices) must be the same "
            "non-empty range 0..n-1; the checkpoint is not a LlamaGen VQ model or is truncated."
        )
    n = len(enc_levels)
    encoder_ch_mult = [_mult(sd, f"encoder.conv_blocks.{i}.res.0.conv1.weight", ch) for i in range(n)]
    decoder_ch_mult = [_mult(sd, f"decoder.conv_blocks.{n - 1 - i}.res.0.conv1.weight", ch) for i in range(n)]
    num_res_blocks = len(_indices(sd, r"encoder\.conv_blocks\.0\.res\.(\d+)\."))
    dec_res = len(_indices(sd, r"decoder\.conv_blocks\.0\.res\.(\d+)\."))
    if dec_res != num_res_blocks + 1:
        raise CheckpointError(
            f"The decoder has {dec_res} res blocks per level but the encoder {num_res_blocks}; LlamaGen's decoder "
            "has num_res_blocks + 1. This checkpoint has another architecture."
        )
    return {
        "codebook_size": v,
        "codebook_embed_dim": c,
        "codebook_show_usage": USAGE_KEY in sd,
        "encoder_ch_mult": encoder_ch_mult,
        "decoder_ch_mult": decoder_ch_mult,
        "z_channels": _shape(sd, "encoder.conv_out.weight", 4)[0],
        "in_channels": in_channels,
        "out_channels": _shape(sd, "decoder.conv_out.weight", 4)[0],
        "ch": ch,
        "num_res_blocks": num_res_blocks,
    }


def convert_llamagen_vq(
    path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    config: str | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> LlamaGenVQ:
    """`load_llamagen_vq(path, config, **kwargs)` then `save_pretrained(output_dir)` (config.json + safetensors);
    reload with `LlamaGenVQ.from_pretrained(output_dir)`."""
    model = load_llamagen_vq(path, config, **kwargs)
    model.save_pretrained(os.fspath(output_dir))
    return model


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m image_ar.llamagen.convert_vq SRC DST [--config vq_16|vq_8] [--prefer KEY] [--allow-pickle]
    [--norm-num-groups N]`; returns the exit status."""
    parser = argparse.ArgumentParser(description="Convert an official LlamaGen VQ checkpoint to a diffusers folder.")
    parser.add_argument("src", help="vq_ds16_c2i.pt / vq_ds16_t2i.pt / vq_ds8_c2i.pt (or a compatible file)")
    parser.add_argument("dst", help="output folder (diffusers save_pretrained layout)")
    parser.add_argument("--config", choices=sorted(PRESETS), default=None, help="preset (default: infer)")
    parser.add_argument("--prefer", default=None, help="container key to read (default: ema, model, state_dict)")
    parser.add_argument("--allow-pickle", action="store_true", help="full unpickling: trusted files only")
    parser.add_argument("--norm-num-groups", type=int, default=None,
                        help="GroupNorm groups of a non-official checkpoint (official: 32)")
    args = parser.parse_args(argv)
    extra = {} if args.norm_num_groups is None else {"norm_num_groups": args.norm_num_groups}
    model = convert_llamagen_vq(args.src, args.dst, args.config, prefer=args.prefer, allow_pickle=args.allow_pickle,
                                **extra)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved LlamaGenVQ ({n / 1e6:.1f}M parameters, downsample {model.downsample_factor}) to {args.dst}")
    return 0


# ----------------------------------------------------------------------------------------------- helpers
def _shape(sd: Mapping[str, torch.Tensor], key: str, ndim: int) -> list[int]:
    shape = list(getattr(sd[key], "shape", ()))
    if len(shape) != ndim:
        raise CheckpointError(f"{key} has shape {shape}, expected {ndim} dimensions; not a LlamaGen VQ checkpoint.")
    return shape


def _indices(sd: Mapping[str, Any], pattern: str) -> list[int]:
    rx = re.compile("^" + pattern)
    return sorted({int(m.group(1)) for k in sd if (m := rx.match(k))})


def _mult(sd: Mapping[str, torch.Tensor], key: str, ch: int) -> int:
    if key not in sd:
        raise CheckpointError(f"{key} is missing; cannot infer the channel multipliers. The checkpoint is truncated.")
    width = _shape(sd, key, 4)[0]
    if width % ch:
        raise CheckpointError(f"{key} has {width} output channels, not a multiple of the base width ch = {ch}.")
    return width // ch


def _check_official_groups(kwargs: Mapping[str, Any]) -> None:
    widths = sorted({kwargs["ch"] * m for m in (*kwargs["encoder_ch_mult"], *kwargs["decoder_ch_mult"])})
    if any(w % OFFICIAL_NORM_GROUPS for w in widths):
        raise InputError(
            f"The checkpoint's block widths {widths} are not all divisible by the official GroupNorm(32), so it is "
            "not an official LlamaGen tokenizer and its group count cannot be read from the weights: pass "
            "norm_num_groups=<the value it was trained with> (or a full config dict)."
        )


def _check_file_name(path: str | os.PathLike[str], kwargs: Mapping[str, Any]) -> None:
    """Warn when an official file name ('vq_ds16_...') disagrees with the downsample factor of the weights."""
    match = re.search(r"ds(\d+)", Path(path).name)
    factor = 2 ** (len(kwargs["encoder_ch_mult"]) - 1)
    if match and int(match.group(1)) != factor:
        warnings.warn(
            f"{Path(path).name} says downsample {match.group(1)} but its weights have {len(kwargs['encoder_ch_mult'])}"
            f" levels (downsample {factor}); using the weights.",
            stacklevel=3,
        )


def _config_fields() -> list[str]:
    return [p for p in inspect.signature(LlamaGenVQ.__init__).parameters if p != "self"]


if __name__ == "__main__":
    raise SystemExit(main())
