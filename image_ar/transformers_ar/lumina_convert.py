"""`mmspec convert lumina-mgpt`: an official Lumina-mGPT folder (1.0 or 2.0) and its image tokenizer -> a folder
`LuminaMGPTPipeline` loads with transformers' own `ChameleonForConditionalGeneration`.

    mmspec convert lumina-mgpt --model Lumina-mGPT-7B-768 --vqgan ckpts/chameleon/tokenizer/vqgan.ckpt \
        --out lumina-mgpt-7b-768
    mmspec convert lumina-mgpt --model Lumina-mGPT-2.0 --vqgan movqgan/270M/movqgan_270M.ckpt --out lumina-mgpt-2

What changes (Lumina-mGPT's fork of transformers' Chameleon -> transformers' own layout), nothing else:
- `self_attn.q_norm` / `k_norm` weight and bias: the fork keeps one [head_dim] row per model-parallel shard
  ([model_parallel_size, head_dim]) and repeats each over its shard's heads in the forward (`repeat_interleave`);
  transformers keeps [heads, head_dim]: the rows are repeated here, once.
- config.json: the fork-only `mask_image_logits` (must be false: an image-writing checkpoint) and `z_loss_weight`
  are dropped, `architectures` names transformers' class, and `lumina_mgpt: {"image_size": N, "version": 1 | 2}`
  records the resolution the checkpoint was trained at (from --image-size, else the folder name's `-512` / `-768` /
  `-1024`; 2.0's official sample size, 768, for a 2.0 folder) and the version (2.0's vocabulary names its image
  tokens `<MOVQGAN*`, 1.0's are Chameleon's `IMGIMG*`).
- 1.0: the image encoder transformers' class holds (`model.vqmodel`: encoder, quantizer, quant convs), when the
  folder lacks it, is written from the VQGAN checkpoint under its own (taming) names, in one more shard (the last;
  the shards are renamed model-0000i-of-0000n.safetensors, with their index). 2.0 does not use that module (its
  tokenizer is MoVQGAN): the pipeline removes it when it loads.
- the image tokenizer itself (decoder included) is written as a diffusers model in `vqgan/`: 1.0's Chameleon VQGAN
  (`image_ar.transformers_ar.chameleon_vqgan`) or 2.0's MoVQGAN (`image_ar.movqgan`), told apart by its weights.
Weights are read shard by shard (safetensors; `.bin` shards with weights-only loading) and written as safetensors;
the tokenizer and generation config files are copied as they are.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from image_ar.movqgan import convert_movqgan, is_movqgan
from image_ar.transformers_ar.chameleon_vqgan import IGNORED_KEYS, convert_chameleon_vqgan
from image_ar.transformers_ar.lumina_mgpt import MOVQGAN_PREFIX
from mmspec.checkpoints import load_state_dict
from mmspec.checkpoints.keys import strip_wrapper_prefixes
from mmspec.data.artifacts import atomic_output_dir
from mmspec.errors import InputError, check

FORK_ONLY = ("mask_image_logits", "z_loss_weight")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
NORM = re.compile(r"\.self_attn\.([qk])_norm\.(weight|bias)$")


def version_of(config: dict) -> int:
    """2 when the vocabulary names MoVQGAN image tokens (Lumina-mGPT 2.0), else 1."""
    return 2 if any(k.startswith(MOVQGAN_PREFIX) for k in config.get("vocabulary_map") or {}) else 1


def image_size_of(folder: Path, given: int | None, version: int = 1) -> int:
    """--image-size, else the folder name's resolution suffix (`Lumina-mGPT-7B-768` -> 768), else for 2.0 its
    official sample script's 768."""
    if given is not None:
        check(given > 0 and given % 32 == 0, f"--image-size must be a positive multiple of 32, got {given}.")
        return given
    found = re.search(r"-(512|768|1024)(?:-|$)", folder.name)
    if found is None and version == 2:
        return 768
    check(found is not None, f"cannot tell the resolution of {folder.name}: pass --image-size (512, 768 or 1024, the "
                             "one in the official model's name).")
    return int(found.group(1))


def convert_config(config: dict, image_size: int, version: int) -> dict:
    """The fork's config.json -> transformers' (see the module docstring); InputError for another model."""
    check(config.get("model_type") == "chameleon", f"not a Lumina-mGPT folder: config.json's model_type is "
                                                   f"{config.get('model_type')!r}, expected 'chameleon'.")
    check(config.get("mask_image_logits") is not True,
          "config.json sets mask_image_logits true: this checkpoint never writes image tokens (Lumina-mGPT's are "
          "false); it is not an image generator.")
    out = {k: v for k, v in config.items() if k not in FORK_ONLY}
    out["architectures"] = ["ChameleonForConditionalGeneration"]
    out["lumina_mgpt"] = {"image_size": image_size, "version": version}
    return out


def expand_norms(sd: Mapping[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """q_norm / k_norm [shards, head_dim] -> [heads, head_dim] (each shard's row over its heads, in order)."""
    heads = {"q": config["num_attention_heads"],
             "k": config.get("num_key_value_heads") or config["num_attention_heads"]}
    out = dict(sd)
    for key, value in sd.items():
        match = NORM.search(key)
        if match is None:
            continue
        n = heads[match.group(1)]
        rows = value.shape[0]
        check(value.dim() == 2 and n % rows == 0, f"{key} has shape {list(value.shape)}; expected [shards, head_dim] "
                                                  f"with shards dividing the {n} heads.")
        out[key] = value.repeat_interleave(n // rows, dim=0).contiguous()
    return out


def weight_files(folder: Path) -> list[Path]:
    files = sorted([*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")])
    check(len(files) > 0, f"no weights in {folder} (*.safetensors or pytorch_model*.bin).")
    return files


def read_shard(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    return load_file(str(path)) if path.suffix == ".safetensors" else load_state_dict(path, allow_pickle=allow_pickle)


def encoder_weights(vqgan_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The VQGAN's weights transformers' `ChameleonVQVAE` holds (all but the decoder), as `model.vqmodel.*`."""
    skip = re.compile("|".join((r"^decoder\.", *IGNORED_KEYS)))
    return {f"model.vqmodel.{k}": v.contiguous() for k, v in vqgan_sd.items() if not skip.search(k)}


def convert_lumina_mgpt(model: str | Path, vqgan: str | Path, out: str | Path, image_size: int | None = None,
                        allow_pickle: bool = False) -> Path:
    """Write the converted folder `out` (atomically) from the official folder `model` and its image tokenizer's
    checkpoint `vqgan` (1.0: Meta's `vqgan.ckpt`; 2.0: `movqgan_270M.ckpt`)."""
    src = Path(model)
    check((src / "config.json").is_file(), f"no config.json in {src}: pass the official Lumina-mGPT folder.")
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"could not read {src / 'config.json'}: {err}") from None
    version = version_of(config)
    new_config = convert_config(config, image_size_of(src, image_size, version), version)
    files = weight_files(src)
    vqgan_sd = strip_wrapper_prefixes(load_state_dict(vqgan, allow_pickle=allow_pickle))
    movq = is_movqgan(vqgan_sd)
    check(movq == (version == 2),
          f"{Path(vqgan).name} is {'a MoVQGAN' if movq else 'a Chameleon VQGAN'} checkpoint, but "
          f"{src.name} is Lumina-mGPT {'2.0' if version == 2 else '1.0'}: pass "
          f"{'movqgan_270M.ckpt' if version == 2 else 'Meta Chameleon vqgan.ckpt'} as --vqgan.")
    # every image-tokenizer weight is checked before anything is written
    vq_model = convert_movqgan(vqgan_sd) if movq else convert_chameleon_vqgan(vqgan_sd)
    shard_keys: list[list[str]] = []
    with atomic_output_dir(out) as tmp:
        tmp = Path(tmp)
        for i, path in enumerate(tqdm(files, desc="converting weight shards", unit="shard", disable=len(files) < 2)):
            sd = expand_norms(read_shard(path, allow_pickle), config)
            save_file(sd, str(tmp / f"part-{i}.safetensors"), metadata={"format": "pt"})
            shard_keys.append(list(sd))
        has_encoder = any(k.startswith("model.vqmodel.") for keys in shard_keys for k in keys)
        if version == 1 and not has_encoder:  # the image encoder transformers' class holds, from the VQGAN
            vq = encoder_weights(vqgan_sd)
            save_file(vq, str(tmp / f"part-{len(files)}.safetensors"), metadata={"format": "pt"})
            shard_keys.append(list(vq))
        weight_map: dict[str, str] = {}
        for i, keys in enumerate(shard_keys):
            name = f"model-{i + 1:05d}-of-{len(shard_keys):05d}.safetensors"
            (tmp / f"part-{i}.safetensors").rename(tmp / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEXES[0]).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2))
        skip = {p.name for p in files} | {"config.json", *INDEXES}
        for path in src.iterdir():
            if path.is_file() and path.name not in skip:
                shutil.copy2(path, tmp / path.name)
        vq_model.save_pretrained(tmp / "vqgan")
    return Path(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the official Lumina-mGPT folder (e.g. Lumina-mGPT-7B-768)")
    parser.add_argument("--vqgan", required=True,
                        help="the image tokenizer: Meta's Chameleon vqgan.ckpt (1.0) or movqgan_270M.ckpt (2.0)")
    parser.add_argument("--out", required=True, help="pipeline folder to write")
    parser.add_argument("--image-size", type=int, default=None,
                        help="the resolution the model was trained at (default: from the folder name)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read checkpoints with full pickle (runs code from them: only for files you trust)")


def run(args: argparse.Namespace) -> int:
    out = convert_lumina_mgpt(args.model, args.vqgan, args.out, args.image_size, args.allow_pickle)
    print(f"wrote {out} (LuminaMGPTPipeline: transformers' Chameleon, the tokenizer and the image tokenizer in vqgan/)")
    return 0
