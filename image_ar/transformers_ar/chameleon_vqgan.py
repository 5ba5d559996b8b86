"""Chameleon's VQGAN, the image tokenizer of Chameleon and Lumina-mGPT, as a diffusers model: `LlamaGenVQ` with the
`chameleon` preset, loaded from Meta's `vqgan.ckpt` (facebookresearch/chameleon; Lumina-mGPT reads it from
`ckpts/chameleon/tokenizer/`).

    vqgan = load_chameleon_vqgan("ckpts/chameleon/tokenizer/vqgan.ckpt")   # safe loading; LlamaGenVQ, eval mode
    images = vqgan.decode_code(codes, (N, 256, 48, 48))                     # [N, 3, 768, 768] in about [-1, 1]

The official model is taming-transformers' `VQModel` (Lumina-mGPT `model/chameleon_vae_ori/vqgan.py`): the encoder
and decoder of `image_ar.conv_autoencoder` with ch 128, ch_mult [1, 1, 2, 2, 4] (16 pixels a code), 2 blocks a level
(3 in the decoder), attention only in the mid blocks (`attn_resolutions: []`), GroupNorm(32); quant_conv and
post_quant_conv (1x1, 256 <-> 256); the legacy `VectorQuantizer2` (8192 x 256 codes compared by squared L2 distance,
unnormalised). transformers' `ChameleonVQVAE` holds the same encoder and quantizer under the same key names, but no
decoder. The checkpoint is a Lightning file: its `state_dict` also holds the training loss's discriminator and
LPIPS weights (`loss.*`), which the official `init_from_ckpt(strict=False)` skips and so does this loader.
Keys are renamed by `rename_taming_keys`; the config is read from the weight shapes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from image_ar.conv_autoencoder import rename_taming_keys, taming_levels
from image_ar.llamagen.vq import PRESETS, LlamaGenVQ
from mmspec.checkpoints import load_into, load_state_dict
from mmspec.checkpoints.keys import strip_wrapper_prefixes
from mmspec.errors import CheckpointError, check_float_dtype

IGNORED_KEYS = (r"^loss\.",)  # the training loss's discriminator / LPIPS weights in the Lightning checkpoint


def infer_chameleon_vqgan_config(sd: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`LlamaGenVQ` arguments of a taming VQModel state dict: codes and their width from `quantize.embedding`, ch
    from `encoder.conv_in`, ch_mult from each level's first block, the blocks a level, z_channels from
    `quant_conv`, level attention from `encoder.down.{i}.attn.*`; CheckpointError in one line otherwise."""
    needed = ("quantize.embedding.weight", "encoder.conv_in.weight", "quant_conv.weight",
              "encoder.mid.block_1.conv1.weight")
    missing = [k for k in needed if k not in sd]
    if missing:
        raise CheckpointError(f"not a Chameleon (taming) VQGAN checkpoint: {', '.join(missing)} missing (found e.g. "
                              f"{', '.join(list(sd)[:5])}).")
    if "encoder.mid.attn_1.q.weight" not in sd:
        raise CheckpointError("this VQGAN has no mid-block attention (taming attn_type 'none'); Chameleon's has it, "
                              "and mmspec's encoder and decoder always build it.")
    codes, dim = sd["quantize.embedding.weight"].shape
    ch = sd["encoder.conv_in.weight"].shape[0]
    levels = taming_levels(sd, "encoder.down")
    ch_mult = tuple(sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch for i in range(levels))
    blocks = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"^encoder\.down\.0\.block\.(\d+)\.", k)))
    level_attention = any(re.match(r"^(encoder\.down|decoder\.up)\.\d+\.attn\.", k) for k in sd)
    return {**PRESETS["chameleon"], "codebook_size": codes, "codebook_embed_dim": dim, "ch": ch,
            "encoder_ch_mult": ch_mult, "decoder_ch_mult": ch_mult, "num_res_blocks": blocks,
            "z_channels": sd["quant_conv.weight"].shape[1], "level_attention": level_attention}


def convert_chameleon_vqgan(sd: Mapping[str, torch.Tensor]) -> LlamaGenVQ:
    """A taming VQModel state dict (Chameleon's layout) -> `LlamaGenVQ` in eval mode, every weight checked."""
    sd = strip_wrapper_prefixes(sd)
    model = LlamaGenVQ(**infer_chameleon_vqgan_config(sd))  # 70M parameters: initialised normally, then loaded
    load_into(model, rename_taming_keys(sd), ignore_unexpected=IGNORED_KEYS)
    return model.eval()


def load_chameleon_vqgan(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
                         allow_pickle: bool = False) -> LlamaGenVQ:
    """Meta's `vqgan.ckpt` (or any file / folder of its weights) -> `LlamaGenVQ` in `dtype`, eval mode, on the CPU.
    Read with `torch.load(weights_only=True)`; a Lightning file that pickles other objects needs `allow_pickle=True`
    (only for a file you trust), as the loader's one-line error says."""
    check_float_dtype(dtype)
    model = convert_chameleon_vqgan(load_state_dict(path, allow_pickle=allow_pickle))
    return nn.Module.to(model, dtype=dtype)
