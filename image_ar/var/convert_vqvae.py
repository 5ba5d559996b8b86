"""Load the official VAR VQVAE (`vae_ch160v4096z32.pth`, a raw state dict) into `VARVQVAE`.

`VARVQVAE` shares LlamaGen's encoder/decoder modules, whose names differ from the official LDM-style ones: the
converter renames them with `image_ar.conv_autoencoder.rename_taming_keys` (which splits the fused qkv convs)
and keeps `quant_conv`, `post_quant_conv`, `quantize.embedding.weight` and `quantize.quant_resi.qresi_ls.{k}`;
`quantize.ema_vocab_hit_SV` (training statistics) is dropped. Config inference: vocab_size and z_channels from
`quantize.embedding.weight`, ch from `encoder.conv_in.weight`, ch_mult from each level's first block, the
blocks per level, share_quant_resi from the Phi count, quant_conv_ks from `quant_conv.weight`; patch_nums are the
official schedule unless given. The attention math is unchanged by the split (the official code scales by
C^-0.5, as `F.scaled_dot_product_attention` does).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from image_ar.conv_autoencoder import rename_taming_keys, taming_config
from image_ar.var.convert import OFFICIAL_PATCH_NUMS
from image_ar.var.vqvae import VARVQVAE
from mmspec.checkpoints import load_into, load_state_dict
from mmspec.checkpoints.keys import strip_wrapper_prefixes
from mmspec.errors import check_float_dtype

IGNORED_KEYS = (r"^quantize\.ema_vocab_hit_SV$",)


def infer_vqvae_config(sd: Mapping[str, torch.Tensor], **known: Any) -> dict[str, Any]:
    """VARVQVAE arguments from an official state dict (its shape read by `taming_config`); `known` wins."""
    found = taming_config(sd, "VAR VQVAE")
    phis = [int(m.group(1)) for k in sd if (m := re.match(r"^quantize\.quant_resi\.qresi_ls\.(\d+)\.", k))]
    cfg: dict[str, Any] = {"vocab_size": found["codebook_size"], "z_channels": found["codebook_embed_dim"],
                           "ch": found["ch"], "ch_mult": found["ch_mult"], "num_res_blocks": found["num_res_blocks"],
                           "share_quant_resi": 1 + max(phis) if phis else 4, "quant_resi": 0.5 if phis else 0.0,
                           "quant_conv_ks": sd["quant_conv.weight"].shape[-1], "patch_nums": OFFICIAL_PATCH_NUMS}
    cfg.update(known)
    return cfg


def load_var_vqvae(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, allow_pickle: bool = False,
                   **overrides: Any) -> VARVQVAE:
    """Build a `VARVQVAE` from the official `vae_ch160v4096z32.pth`, in eval mode, in `dtype` on the CPU."""
    check_float_dtype(dtype)
    sd = strip_wrapper_prefixes(load_state_dict(path, allow_pickle=allow_pickle))
    cfg = infer_vqvae_config(sd, **overrides)
    model = VARVQVAE(**cfg)  # small enough to initialise normally
    load_into(model, rename_taming_keys(sd), ignore_unexpected=IGNORED_KEYS)
    return nn.Module.to(model, dtype=dtype).eval()
