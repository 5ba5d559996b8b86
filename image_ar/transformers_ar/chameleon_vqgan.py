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
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from image_ar.conv_autoencoder import rename_taming_keys, taming_config
from image_ar.llamagen.vq import PRESETS, LlamaGenVQ
from mmspec.checkpoints import load_into, load_state_dict
from mmspec.checkpoints.keys import strip_wrapper_prefixes
from mmspec.errors import CheckpointError, check_float_dtype

IGNORED_KEYS = (r"^loss\.",)  # the training loss's discriminator / LPIPS weights in the Lightning checkpoint


def infer_chameleon_vqgan_config(sd: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`LlamaGenVQ` arguments of a taming VQModel state dict (`taming_config`); CheckpointError in one line
    otherwise, and for a VQGAN without mid-block attention (taming's attn_type 'none')."""
    found = taming_config(sd, "Chameleon (taming) VQGAN", needed=("encoder.mid.block_1.conv1.weight",))
    if "encoder.mid.attn_1.q.weight" not in sd:
        raise CheckpointError("this VQGAN has no mid-block attention (taming attn_type 'none'); Chameleon's has it, "
                              "and mmspec's encoder and decoder always build it.")
    mult = found.pop("ch_mult")
    return {**PRESETS["chameleon"], **found, "encoder_ch_mult": mult, "decoder_ch_mult": mult}


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
