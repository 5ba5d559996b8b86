"""LlamaGen's VQ image tokenizer (VQ-16 / VQ-8) as a diffusers model: `LlamaGenVQ(ModelMixin, ConfigMixin)`.

Architecture (FoundationVision/LlamaGen `tokenizer/tokenizer_image/vq_model.py`, re-implemented from its facts):

    images [B, 3, H, W] in [-1, 1]
      -> encoder (conv_in; one level per ch_mult entry: num_res_blocks ResnetBlocks, + an AttnBlock after each
         of them at the lowest resolution, + a stride-2 Downsample except at the last level; mid = Resnet, Attn,
         Resnet; GroupNorm, swish, conv_out)                                        -> [B, z_channels, h, w]
      -> quant_conv (1x1, z_channels -> codebook_embed_dim)                         -> [B, C, h, w]
      -> quantize: L2-normalise the vectors and the codebook, nearest code, straight-through estimator
                                                                                    -> [B, C, h, w], ids [B, h, w]
      -> post_quant_conv (1x1, C -> z_channels) -> decoder (mirror image of the encoder with num_res_blocks + 1
         blocks per level and nearest-neighbour x2 Upsample)                        -> [B, 3, H, W], nominally [-1, 1]

with h = H / f, w = W / f and the downsample factor f = 2 ** (len(ch_mult) - 1): 16 for VQ-16 (ch_mult
[1, 1, 2, 2, 4]), 8 for VQ-8 ([1, 2, 2, 4]). The module tree reproduces the official state-dict keys
(`encoder.conv_blocks.{i}.res.{j}.conv1.weight`, `...attn.{j}.q.weight`, `...downsample.conv.weight`,
`encoder.mid.{0,1,2}`, `encoder.norm_out`, `encoder.conv_out`, `quant_conv`, `quantize.embedding.weight`,
`quantize.codebook_used`, `post_quant_conv`, `decoder...upsample.conv.weight`, `nin_shortcut`), so official
checkpoints load after unwrapping their container (see `convert_vq.load_llamagen_vq`).

Differences from the official code, none of which changes the outputs: attention uses
`F.scaled_dot_product_attention` (same scale 1/sqrt(C)); the nearest-code search runs in float32 and in row chunks
(same distance formula); the GroupNorm group count is a config value (`norm_num_groups`, official 32) so tiny test
models with fewer channels can be built. The quantizer's codebook and commitment losses are always returned (they
are two small MSEs), the entropy loss only when `entropy_loss_ratio > 0`; the official code returns them in
training mode only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from torch import nn

from image_ar.conv_autoencoder import Decoder, Encoder
from mmspec.errors import InputError, check, check_nonnegative, check_positive_int
from mmspec.vae_slicing import SlicedDecodeMixin

__all__ = [
    "PRESETS",
    "TINY_CH_MULT",
    "LlamaGenVQ",
    "LlamaGenVQOutput",
    "VQEncodeOutput",
    "VQLosses",
    "VectorQuantizer",
    "entropy_loss",
]

# Official ModelArgs of VQ-16 / VQ-8 (everything else at the ModelArgs / Encoder / Decoder defaults).
PRESETS: dict[str, dict[str, Any]] = {
    "vq_16": {"encoder_ch_mult": (1, 1, 2, 2, 4), "decoder_ch_mult": (1, 1, 2, 2, 4)},
    "vq_8": {"encoder_ch_mult": (1, 2, 2, 4), "decoder_ch_mult": (1, 2, 2, 4)},
    # Chameleon's VQGAN (Meta's `vqgan.yaml`, Lumina-mGPT's image tokenizer): taming's VQModel with 8192 codes of
    # 256 dims compared unnormalised (its legacy quantizer), attention only in the mid blocks
    "chameleon": {"encoder_ch_mult": (1, 1, 2, 2, 4), "decoder_ch_mult": (1, 1, 2, 2, 4), "codebook_size": 8192,
                  "codebook_embed_dim": 256, "codebook_l2_norm": False, "codebook_show_usage": False,
                  "level_attention": False},
}
# ch_mult of the tiny test/example models per downsample factor (`LlamaGenVQ.tiny`).
TINY_CH_MULT: dict[int, tuple[int, ...]] = {
    1: (1,),
    2: (1, 2),
    4: (1, 2, 2),
    8: (1, 1, 2, 2),
    16: (1, 1, 2, 2, 4),
}
USAGE_WINDOW = 65536  # length of the official `codebook_used` buffer (recent code ids, for usage statistics)
_RANGE_TOL = 1e-3  # images may exceed [-1, 1] by this much (rounding) before `encode` refuses them
_SEARCH_CHUNK_ELEMENTS = 1 << 24  # rows x codes of one distance block in the nearest-code search (64 MiB fp32)


# ------------------------------------------------------------------------------------------------ outputs
class VQLosses(NamedTuple):
    """The quantizer's auxiliary losses, in the official order `(vq_loss, commit_loss, entropy_loss, usage)`.

    `commit_loss` already carries `commit_loss_beta` and `entropy_loss` `entropy_loss_ratio`, as in the
    official code; `codebook_usage` (fraction of codes among the last 65536 ids) is set only in training mode
    with `codebook_show_usage`, else None.
    """

    codebook_loss: torch.Tensor  # [] mean ||sg(z) - z_q||^2: moves the codes
    commit_loss: torch.Tensor  # [] beta * mean ||z - sg(z_q)||^2: moves the encoder
    entropy_loss: torch.Tensor  # [] ratio * (per-sample entropy - batch entropy) of softmax(-d / 0.01)
    codebook_usage: float | None = None

    @property
    def total(self) -> torch.Tensor:
        """codebook + commitment + entropy, the quantizer's part of the training loss (official weights)."""
        return self.codebook_loss + self.commit_loss + self.entropy_loss


class VQEncodeOutput(NamedTuple):
    """What `LlamaGenVQ.encode` returns; unpacks as `latents, ids, losses`."""

    latents: torch.Tensor  # [B, C, h, w] quantized (straight-through) latents, C = codebook_embed_dim
    ids: torch.Tensor  # [B, h, w] int64 code ids
    losses: VQLosses


@dataclass
class LlamaGenVQOutput(BaseOutput):
    """`LlamaGenVQ.forward` output: the reconstruction and what the encoder produced on the way."""

    sample: torch.Tensor  # [B, out_channels, H, W] reconstruction, nominally in [-1, 1]
    latents: torch.Tensor | None = None  # [B, C, h, w]
    ids: torch.Tensor | None = None  # [B, h, w]
    losses: VQLosses | None = None


# ------------------------------------------------------------------------------------------------ quantizer
def entropy_loss(affinity: torch.Tensor, temperature: float = 0.01) -> torch.Tensor:
    """Official `compute_entropy_loss(affinity)` ('softmax' target): mean per-row entropy minus the entropy of
    the mean distribution of softmax(affinity / temperature). affinity [N, V] (the official call passes -d)."""
    logits = affinity.reshape(-1, affinity.shape[-1]) / temperature  # [N, V]
    probs = F.softmax(logits, dim=-1)
    log_probs = F.log_softmax(logits + 1e-5, dim=-1)
    avg_probs = probs.mean(dim=0)  # [V]
    avg_entropy = -(avg_probs * torch.log(avg_probs + 1e-5)).sum()
    sample_entropy = -(probs * log_probs).sum(dim=-1).mean()
    return sample_entropy - avg_entropy


class VectorQuantizer(nn.Module):
    """Nearest-code quantizer with L2-normalised codes and inputs (when `l2_norm`), straight-through gradients,
    codebook/commitment/entropy losses and an optional sliding window of recent ids (`codebook_used`)."""

    def __init__(self, n_e: int, e_dim: int, beta: float, entropy_loss_ratio: float, l2_norm: bool,
                 show_usage: bool) -> None:
        super().__init__()
        self.n_e, self.e_dim, self.beta = n_e, e_dim, beta
        self.entropy_loss_ratio, self.l2_norm, self.show_usage = entropy_loss_ratio, l2_norm, show_usage
        self.embedding = nn.Embedding(n_e, e_dim)  # [V, C]
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / n_e, 1.0 / n_e)
            if l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, p=2, dim=-1))
        if show_usage:
            self.register_buffer("codebook_used", torch.zeros(USAGE_WINDOW))  # [65536] recent ids, as floats

    def codebook(self) -> torch.Tensor:
        """[V, C] the code vectors the quantizer compares against (L2-normalised when `l2_norm`)."""
        weight = self.embedding.weight
        return F.normalize(weight, p=2, dim=-1) if self.l2_norm else weight

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> code vectors [..., C]."""
        return self.codebook()[ids]

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, VQLosses]:
        """z [B, C, h, w] -> (z_q [B, C, h, w] straight-through, ids [B, h, w], losses)."""
        b, c, hh, ww = z.shape
        zc = z.permute(0, 2, 3, 1).float()  # [B, h, w, C] channels last, float32 for the search
        emb = self.codebook().float()  # [V, C]
        if self.l2_norm:
            zc = F.normalize(zc, p=2, dim=-1)
        flat = zc.reshape(-1, c)  # [N, C], N = B*h*w
        need_d = self.entropy_loss_ratio > 0
        ids, d = _nearest_codes(flat, emb, keep_distances=need_d)  # [N], [N, V] or None
        zq = emb[ids].view(zc.shape)  # [B, h, w, C]

        codebook_loss = torch.mean((zq - zc.detach()) ** 2)
        commit_loss = self.beta * torch.mean((zq.detach() - zc) ** 2)
        ent = self.entropy_loss_ratio * entropy_loss(-d) if d is not None else zq.new_zeros(())
        usage = self._update_usage(ids) if (self.show_usage and self.training) else None

        if zc.requires_grad:  # straight-through estimator; without autograd the latents are exactly the codes
            zq = zc + (zq - zc).detach()
        zq = zq.permute(0, 3, 1, 2).to(z.dtype)  # [B, C, h, w]
        return zq, ids.view(b, hh, ww), VQLosses(codebook_loss, commit_loss, ent, usage)

    @torch.no_grad()
    def _update_usage(self, ids: torch.Tensor) -> float:
        """Push the batch's ids into the `codebook_used` window; fraction of codes seen in it (host sync)."""
        window = self.codebook_used  # [65536]
        recent = ids[-window.numel():].to(window.dtype)
        n = recent.numel()
        window.copy_(torch.cat([window[n:], recent]))
        return len(torch.unique(window)) / self.n_e


def _nearest_codes(flat: torch.Tensor, emb: torch.Tensor,
                   keep_distances: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flat [N, C], emb [V, C] -> (argmin_j ||flat_i - emb_j||^2 [N], the distances [N, V] if asked).

    Uses the official expansion |z|^2 + |e|^2 - 2 z.e; without `keep_distances` the rows go in chunks so the
    [N, V] matrix never has to exist at once (a 64-image 384-px batch with V = 16384 would be 2.4 GB).
    """
    e2 = (emb**2).sum(dim=1)  # [V]

    def dist(rows: torch.Tensor) -> torch.Tensor:  # [n, C] -> [n, V]
        return (rows**2).sum(dim=1, keepdim=True) + e2 - 2 * rows @ emb.t()

    if keep_distances:
        d = dist(flat)
        return d.argmin(dim=1), d
    chunk = max(1, _SEARCH_CHUNK_ELEMENTS // max(1, emb.shape[0]))
    if flat.shape[0] <= chunk:
        return dist(flat).argmin(dim=1), None
    return torch.cat([dist(part).argmin(dim=1) for part in flat.split(chunk)]), None


# -------------------------------------------------------------------------------------------------- model
class LlamaGenVQ(SlicedDecodeMixin, ModelMixin, ConfigMixin):
    """LlamaGen's VQ tokenizer. Defaults are the official VQ-16 (`vq_ds16_c2i.pt`, 72M parameters).

    Config (the official `ModelArgs` fields first, then the Encoder/Decoder arguments the official code fixes):
        codebook_size (16384), codebook_embed_dim (8), codebook_l2_norm (True), codebook_show_usage (True: keeps
        the `quantize.codebook_used` buffer the official checkpoints carry), commit_loss_beta (0.25),
        entropy_loss_ratio (0.0: off), encoder_ch_mult / decoder_ch_mult ((1, 1, 2, 2, 4)), z_channels (256),
        dropout_p (0.0), in_channels / out_channels (3), ch (128: base width), num_res_blocks (2 per encoder
        level; the decoder uses num_res_blocks + 1 = 3, as official), norm_num_groups (32, official; tiny models
        use fewer, since every width ch * mult must be divisible by it), level_attention (True: attention after
        each block of the lowest-resolution level, as LlamaGen; False: none there, taming's `attn_resolutions: []`).

    Images are [B, 3, H, W] in [-1, 1] with H and W multiples of `downsample_factor`; token grids are
    [B, h, w] = [B, H / f, W / f] in raster order when flattened.
    """

    @register_to_config
    def __init__(
        self,
        codebook_size: int = 16384,
        codebook_embed_dim: int = 8,
        codebook_l2_norm: bool = True,
        codebook_show_usage: bool = True,
        commit_loss_beta: float = 0.25,
        entropy_loss_ratio: float = 0.0,
        encoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
        decoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
        z_channels: int = 256,
        dropout_p: float = 0.0,
        in_channels: int = 3,
        out_channels: int = 3,
        ch: int = 128,
        num_res_blocks: int = 2,
        norm_num_groups: int = 32,
        level_attention: bool = True,
    ) -> None:
        super().__init__()
        _check_config(codebook_size, codebook_embed_dim, commit_loss_beta, entropy_loss_ratio, encoder_ch_mult,
                      decoder_ch_mult, z_channels, dropout_p, in_channels, out_channels, ch, num_res_blocks,
                      norm_num_groups)
        check(isinstance(level_attention, bool), f"level_attention must be a bool, got {level_attention!r}.")
        self.encoder = Encoder(in_channels, ch, tuple(encoder_ch_mult), num_res_blocks, z_channels, dropout_p,
                               norm_num_groups, level_attention)
        self.decoder = Decoder(out_channels, ch, tuple(decoder_ch_mult), num_res_blocks, z_channels, dropout_p,
                               norm_num_groups, level_attention)
        self.quantize = VectorQuantizer(codebook_size, codebook_embed_dim, commit_loss_beta, entropy_loss_ratio,
                                        codebook_l2_norm, codebook_show_usage)
        self.quant_conv = nn.Conv2d(z_channels, codebook_embed_dim, kernel_size=1)
        self.post_quant_conv = nn.Conv2d(codebook_embed_dim, z_channels, kernel_size=1)

    # ----------------------------------------------------------------------------------------- presets
    @classmethod
    def vq_16(cls, **overrides: Any) -> LlamaGenVQ:
        """Official VQ-16: ch_mult [1, 1, 2, 2, 4], 16x16 tokens for 256 px (`vq_ds16_c2i.pt`, `vq_ds16_t2i.pt`)."""
        return cls.from_preset("vq_16", **overrides)

    @classmethod
    def vq_8(cls, **overrides: Any) -> LlamaGenVQ:
        """Official VQ-8: ch_mult [1, 2, 2, 4], 32x32 tokens for 256 px (`vq_ds8_c2i.pt`)."""
        return cls.from_preset("vq_8", **overrides)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LlamaGenVQ:
        """Build `PRESETS[name]` ('vq_16', 'vq_8' or 'chameleon') with config `overrides` (e.g. codebook_size=...)."""
        if name not in PRESETS:
            raise InputError(f"preset {name!r} is unknown; use one of {sorted(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def tiny(cls, downsample_factor: int = 8, **overrides: Any) -> LlamaGenVQ:
        """A small model for tests and examples: ch 32, 1 res block (decoder 2), z 32, 256 codes of dim 8,
        GroupNorm(8); `downsample_factor` in {1, 2, 4, 8, 16} picks ch_mult from `TINY_CH_MULT`."""
        if downsample_factor not in TINY_CH_MULT:
            raise InputError(f"downsample_factor must be one of {sorted(TINY_CH_MULT)}, got {downsample_factor!r}.")
        mult = TINY_CH_MULT[downsample_factor]
        config = {
            "codebook_size": 256, "codebook_embed_dim": 8, "encoder_ch_mult": mult, "decoder_ch_mult": mult,
            "z_channels": 32, "ch": 32, "num_res_blocks": 1, "norm_num_groups": 8,
        }
        return cls(**{**config, **overrides})

    # ------------------------------------------------------------------------------------------ shapes
    @property
    def downsample_factor(self) -> int:
        """Pixels per token side: 2 ** (len(encoder_ch_mult) - 1) (16 for VQ-16, 8 for VQ-8)."""
        return 2 ** (len(self.config.encoder_ch_mult) - 1)

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) token grid of an image of `height` x `width` pixels (both multiples of `downsample_factor`)."""
        f = self.downsample_factor
        for name, value in (("height", height), ("width", width)):
            check(isinstance(value, int) and value > 0 and value % f == 0,
                  f"{name} must be a positive multiple of the downsample factor {f}, got {value!r}; "
                  f"resize or crop the image to a multiple of {f} pixels.")
        return height // f, width // f

    # ---------------------------------------------------------------------------------------- encoding
    def encode(self, images: torch.Tensor, check_range: bool = True) -> VQEncodeOutput:
        """images [B, 3, H, W] in [-1, 1] -> (latents [B, C, h, w], ids [B, h, w], losses).

        `latents` are the quantized codes with straight-through gradients to the encoder. With `check_range`
        (default) values outside [-1, 1] (beyond 1e-3) or NaN raise `InputError` (one host sync); pass
        `check_range=False` in training loops whose data are known to be in range.
        """
        self._check_images(images, check_range)
        h = self.encoder(images.to(self.dtype))  # [B, z_channels, h, w]
        h = self.quant_conv(h)  # [B, C, h, w]
        latents, ids, losses = self.quantize(h)
        return VQEncodeOutput(latents, ids, losses)

    def quantize_ids(self, images: torch.Tensor, check_range: bool = True) -> torch.Tensor:
        """images [B, 3, H, W] in [-1, 1] -> ids [B, h*w] int64 in raster order (the AR models' tokens)."""
        ids = self.encode(images, check_range=check_range).ids  # [B, h, w]
        return ids.reshape(ids.shape[0], -1)

    # ---------------------------------------------------------------------------------------- decoding
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] (quantized) -> images [B, 3, h*f, w*f], nominally in [-1, 1] (not clamped)."""
        check(isinstance(latents, torch.Tensor) and latents.dim() == 4
              and latents.shape[1] == self.config.codebook_embed_dim,
              f"latents must be a [B, {self.config.codebook_embed_dim}, h, w] tensor (C = codebook_embed_dim), got "
              f"{_describe(latents)}; pass encode(...).latents, or use decode_code for token ids.")
        z = self.post_quant_conv(latents.to(self.dtype))  # [B, z_channels, h, w]
        return self.decode_slices(self.decoder, z)  # one image at a time after enable_slicing()

    def decode_code(self, ids: torch.Tensor, shape: Sequence[int] | None = None, clamp: bool = False,
                    fill_missing: bool = False) -> torch.Tensor:
        """Token ids -> images [B, 3, h*f, w*f], nominally in [-1, 1] (official `decode_code` semantics).

        ids: [B, h, w], or [B, h*w] / [B*h*w] in raster order. `shape` = (B, C, h, w) as in the official call
        `decode_code(idx, [B, 8, h, w])`; without it [B, h, w] gives the grid and [B, L] means a square grid.
        The codes are looked up in the (L2-normalised) codebook, then post_quant_conv + decoder. `clamp=True`
        clamps to [-1, 1] (the official code does not; its sample scripts clamp when saving images).
        `fill_missing=True` accepts -1 (a position not generated, e.g. in an interrupted call) and decodes it from a
        zero latent vector (not a code of the codebook).
        """
        ids, grid = self._check_ids(ids, shape, allow_missing=fill_missing)  # [B, h, w], (B, C, h, w)
        latents = self.quantize.lookup(ids.clamp_min(0))  # [B, h, w, C]
        if fill_missing:
            latents = latents * (ids >= 0).unsqueeze(-1).to(latents.dtype)
        latents = latents.permute(0, 3, 1, 2)  # [B, C, h, w]
        images = self.decode(latents)
        return images.clamp(-1.0, 1.0) if clamp else images

    def codebook(self) -> torch.Tensor:
        """[V, C] code vectors as used for lookup (L2-normalised when codebook_l2_norm), e.g. for neighbour
        tables (LANTERN) or embedding tables (GSD). Differentiable; wrap in torch.no_grad() for tables."""
        return self.quantize.codebook()

    def forward(self, images: torch.Tensor, return_dict: bool = True,
                check_range: bool = True) -> LlamaGenVQOutput | tuple[torch.Tensor, VQLosses]:
        """Reconstruct: images [B, 3, H, W] -> `LlamaGenVQOutput(sample, latents, ids, losses)`, or
        `(sample, losses)` with return_dict=False (the official `forward` returns `(dec, diff)`)."""
        latents, ids, losses = self.encode(images, check_range=check_range)
        sample = self.decode(latents)  # [B, 3, H, W]
        if not return_dict:
            return sample, losses
        return LlamaGenVQOutput(sample=sample, latents=latents, ids=ids, losses=losses)

    # ------------------------------------------------------------------------------------------ checks
    def _check_images(self, images: torch.Tensor, check_range: bool) -> None:
        c = self.config.in_channels
        check(isinstance(images, torch.Tensor) and images.dim() == 4 and images.shape[1] == c,
              f"images must be a [B, {c}, H, W] tensor, got {_describe(images)}; add a batch axis with "
              "images[None] or move channels first with images.permute(0, 3, 1, 2).")
        check(images.is_floating_point(),
              f"images must be a floating tensor in [-1, 1], got dtype {images.dtype}; convert uint8 images with "
              "images.float() / 127.5 - 1.")
        self.token_grid(int(images.shape[2]), int(images.shape[3]))
        if check_range and images.numel() > 0:
            lo, hi = torch.aminmax(images.detach())
            lo_f, hi_f = float(lo), float(hi)
            if not (lo_f >= -1 - _RANGE_TOL and hi_f <= 1 + _RANGE_TOL):
                raise InputError(
                    f"images must be in [-1, 1], got values in [{lo_f:.4g}, {hi_f:.4g}]; convert [0, 1] images "
                    "with x * 2 - 1 and uint8 images with x / 127.5 - 1 (NaN also triggers this). Pass "
                    "check_range=False to skip this check."
                )

    def _check_ids(self, ids: torch.Tensor, shape: Sequence[int] | None,
                   allow_missing: bool = False) -> tuple[torch.Tensor, tuple[int, ...]]:
        c, v = self.config.codebook_embed_dim, self.config.codebook_size
        check(isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex()
              and ids.dtype != torch.bool and 1 <= ids.dim() <= 3,
              f"ids must be an integer tensor [B, h, w], [B, h*w] or [B*h*w], got {_describe(ids)}.")
        if shape is not None:
            check(isinstance(shape, Sequence) and len(shape) == 4 and all(isinstance(s, int) for s in shape),
                  f"shape must be (B, C, h, w) as four ints, got {shape!r}.")
            b, sc, hh, ww = shape
            check(sc == c, f"shape[1] must be codebook_embed_dim = {c}, got {sc}.")
            check(ids.numel() == b * hh * ww,
                  f"ids has {ids.numel()} entries but shape {list(shape)} needs B*h*w = {b * hh * ww}.")
        elif ids.dim() == 3:
            b, hh, ww = ids.shape
        elif ids.dim() == 2:
            b, n = ids.shape
            side = math.isqrt(n)
            check(side * side == n,
                  f"ids [B, L] with L = {n} is not a square grid; pass shape=(B, {c}, h, w) or ids as [B, h, w].")
            hh = ww = side
        else:
            raise InputError(f"1-D ids ({ids.numel()} entries) need shape=(B, {c}, h, w).")
        if ids.numel() > 0:
            lo, hi = torch.aminmax(ids)
            lo_i, hi_i, lowest = int(lo), int(hi), -1 if allow_missing else 0
            check(lo_i >= lowest and hi_i < v,
                  f"ids must be in [{lowest}, {v}) (codebook_size), got values in [{lo_i}, {hi_i}]; padding (-1) or "
                  "ids offset into a larger vocabulary must be removed first.")
        return ids.reshape(b, hh, ww).long(), (b, c, hh, ww)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


def _check_config(codebook_size: int, codebook_embed_dim: int, commit_loss_beta: float, entropy_loss_ratio: float,
                  encoder_ch_mult: Sequence[int], decoder_ch_mult: Sequence[int], z_channels: int,
                  dropout_p: float, in_channels: int, out_channels: int, ch: int, num_res_blocks: int,
                  norm_num_groups: int) -> None:
    for name, value in (("codebook_size", codebook_size), ("codebook_embed_dim", codebook_embed_dim),
                        ("z_channels", z_channels), ("in_channels", in_channels), ("out_channels", out_channels),
                        ("ch", ch), ("num_res_blocks", num_res_blocks), ("norm_num_groups", norm_num_groups)):
        check_positive_int(name, value)
    check_nonnegative("commit_loss_beta", commit_loss_beta)
    check_nonnegative("entropy_loss_ratio", entropy_loss_ratio)
    check(0.0 <= dropout_p < 1.0, f"dropout_p must be in [0, 1), got {dropout_p!r}.")
    for name, mult in (("encoder_ch_mult", encoder_ch_mult), ("decoder_ch_mult", decoder_ch_mult)):
        check(isinstance(mult, Sequence) and len(mult) >= 1
              and all(isinstance(m, int) and not isinstance(m, bool) and m > 0 for m in mult),
              f"{name} must be a non-empty list of positive ints (e.g. [1, 1, 2, 2, 4]), got {mult!r}.")
    check(len(encoder_ch_mult) == len(decoder_ch_mult),
          f"encoder_ch_mult {list(encoder_ch_mult)} and decoder_ch_mult {list(decoder_ch_mult)} must have the same "
          "length (the decoder must upsample by the factor the encoder downsamples).")
    widths = sorted({ch * m for m in (*encoder_ch_mult, *decoder_ch_mult)})
    bad = [w for w in widths if w % norm_num_groups]
    check(not bad,
          f"norm_num_groups={norm_num_groups} must divide every block width ch * mult {widths}; {bad} are not "
          "divisible. The official models use 32 with ch 128; tiny models use fewer groups (e.g. 8 with ch 32).")
