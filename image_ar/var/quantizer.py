"""VAR's residual multi-scale quantiser (the `quantize` of its VQVAE) with the shared Phi convolutions.

Facts: VAR (arXiv 2404.02905; FoundationVision/VAR `models/quant.py`). Encoding a feature map f [B, Cvae, H, W]
(H = W = the last patch size) walks the scales from small to large, keeping the running reconstruction f_hat and the
residual f - f_hat:

    z_si   = area-downsample(f - f_hat, pn_si)      (the last scale uses the residual itself)
    idx_si = nearest code of each z_si position (L2; cosine with `using_znorm`)
    f_hat += phi_si(bicubic-upsample(E[idx_si], H))  (no upsampling at the last scale)

phi(h) = (1 - r) h + r conv3x3(h) with r = quant_resi (0.5). With `share_quant_resi` K (official: 4) there are
K convolutions; scale si uses the one whose tick, linspace(1/3K, 1 - 1/3K, K) for K = 4 (else
linspace(1/2K, 1 - 1/2K, K)), is nearest to si / (S - 1) (first on ties, as numpy's argmin). The transformer's
input for scale si + 1 is area-downsample(f_hat after scale si, pn_{si+1}): `teacher_inputs` builds all of them
from a code pyramid (training), `next_input` one at a time (inference). Parameter names follow the official
`vae_ch160v4096z32.pth` (`quantize.embedding.weight`, `quantize.quant_resi.qresi_ls.{k}.weight`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmspec.errors import check


class Phi(nn.Conv2d):
    """h -> (1 - r) h + r conv3x3(h)."""

    def __init__(self, channels: int, resi_ratio: float) -> None:
        super().__init__(channels, channels, kernel_size=3, stride=1, padding=1)
        self.resi_ratio = abs(resi_ratio)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * (1 - self.resi_ratio) + super().forward(h) * self.resi_ratio


class PhiBank(nn.Module):
    """K shared Phi convolutions (`qresi_ls`), or identities when quant_resi is 0."""

    def __init__(self, channels: int, quant_resi: float, count: int) -> None:
        super().__init__()
        make = (lambda: Phi(channels, quant_resi)) if abs(quant_resi) > 1e-6 else nn.Identity
        self.qresi_ls = nn.ModuleList([make() for _ in range(count)])
        k = count
        self.ticks = (np.linspace(1 / 3 / k, 1 - 1 / 3 / k, k) if k == 4 else np.linspace(1 / 2 / k, 1 - 1 / 2 / k, k))

    def index_for(self, scale: int, num_scales: int) -> int:
        at = scale / (num_scales - 1) if num_scales > 1 else 0.0
        return int(np.argmin(np.abs(self.ticks - at)))


class MultiScaleQuantizer(nn.Module):
    """Codebook `embedding` [V, Cvae] + Phi bank; see the module docstring."""

    def __init__(self, vocab_size: int, cvae: int, patch_nums: Sequence[int], quant_resi: float = 0.5,
                 share_quant_resi: int = 4, using_znorm: bool = False, beta: float = 0.25) -> None:
        super().__init__()
        check(share_quant_resi >= 1, f"share_quant_resi must be >= 1 (official: 4), got {share_quant_resi}.")
        self.vocab_size, self.cvae, self.patch_nums = vocab_size, cvae, tuple(patch_nums)
        self.using_znorm, self.beta = using_znorm, beta
        self.embedding = nn.Embedding(vocab_size, cvae)
        self.quant_resi = PhiBank(cvae, quant_resi, share_quant_resi)
        n = len(self.patch_nums)
        self.phi_of_scale = [self.quant_resi.index_for(si, n) for si in range(n)]

    def phi(self, scale: int, h: torch.Tensor) -> torch.Tensor:
        return self.quant_resi.qresi_ls[self.phi_of_scale[scale]](h)

    def nearest_codes(self, z: torch.Tensor) -> torch.Tensor:
        """z [N, Cvae] -> code ids [N] (L2 nearest, or cosine nearest with using_znorm)."""
        codes = self.embedding.weight
        if self.using_znorm:
            return (F.normalize(z, dim=-1) @ F.normalize(codes, dim=-1).T).argmax(-1)
        dist = z.pow(2).sum(-1, keepdim=True) + codes.pow(2).sum(-1) - 2 * z @ codes.T  # [N, V]
        return dist.argmin(-1)

    def upsampled_residual(self, scale: int, idx: torch.Tensor) -> torch.Tensor:
        """phi_si(bicubic(E[idx])) [B, Cvae, H, W] for the codes idx [B, pn_si^2] of scale si."""
        pn, full = self.patch_nums[scale], self.patch_nums[-1]
        h = self.embedding(idx).transpose(1, 2).reshape(idx.shape[0], self.cvae, pn, pn)  # [B, Cvae, pn, pn]
        if pn != full:
            h = F.interpolate(h, size=(full, full), mode="bicubic")
        return self.phi(scale, h)

    def _walk(self, f: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Quantise f [B, Cvae, H, W] scale by scale: yields (the residual vectors quantised [B * pn^2, Cvae],
        codes [B, pn^2], phi(upsampled code map) [B, Cvae, H, W]); codes are found on the detached residual, the
        maps keep their graph for training."""
        b, c, h, w = f.shape
        full = self.patch_nums[-1]
        check(c == self.cvae and h == w == full,
              f"feature map must be [B, {self.cvae}, {full}, {full}] (the last patch size), got {list(f.shape)}.")
        rest = f.detach().float().clone()
        for si, pn in enumerate(self.patch_nums):
            z = rest if pn == full else F.interpolate(rest, size=(pn, pn), mode="area")  # [B, C, pn, pn]
            z_flat = z.permute(0, 2, 3, 1).reshape(-1, c)  # [B * pn^2, C]
            idx = self.nearest_codes(z_flat).view(b, pn * pn)
            h_map = self.upsampled_residual(si, idx)
            rest = rest - h_map.detach()
            yield z_flat, idx, h_map

    @torch.no_grad()
    def encode(self, f: torch.Tensor) -> list[torch.Tensor]:
        """Code pyramid of a feature map f [B, Cvae, H, W]: one [B, pn^2] id tensor per scale."""
        return [idx for _, idx, _ in self._walk(f)]

    @torch.no_grad()
    def restart_dead_codes(self, f: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """Training aid (not in the official trainer): codes that no position of f [B, Cvae, H, W] picks at any
        scale are moved onto randomly chosen residual vectors of f's walk, so they get used and trained.
        Returns how many codes were moved."""
        residuals, used = [], torch.zeros(self.vocab_size, dtype=torch.bool, device=f.device)
        for z_flat, idx, _ in self._walk(f):
            residuals.append(z_flat)
            used[idx.flatten()] = True
        dead = (~used).nonzero().flatten()
        if dead.numel():
            pool = torch.cat(residuals)  # [N, C]
            pick = torch.randint(0, pool.shape[0], (dead.numel(),), generator=generator, device=pool.device)
            self.embedding.weight.data[dead] = pool[pick].to(self.embedding.weight.dtype)
        return int(dead.numel())

    def decode_pyramid(self, pyramid: Sequence[torch.Tensor]) -> torch.Tensor:
        """f_hat [B, Cvae, H, W] of a (full) code pyramid."""
        f_hat = 0
        for si, idx in enumerate(pyramid):
            f_hat = f_hat + self.upsampled_residual(si, idx)
        return f_hat

    def forward(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: (straight-through f_hat [B, Cvae, H, W], VQ loss). The codes are found on the detached f;
        loss = mean over scales of beta * |f_hat_si.detach() - f|^2 + |f_hat_si - f.detach()|^2 (the second term
        trains the codebook and the Phi convolutions, the first the encoder), as the official VectorQuantizer2."""
        f32 = f.float()
        f_hat, loss = torch.zeros_like(f32), f32.new_zeros(())
        for _, _, h_map in self._walk(f32):
            f_hat = f_hat + h_map
            loss = loss + self.beta * F.mse_loss(f_hat.detach(), f32) + F.mse_loss(f_hat, f32.detach())
        return (f_hat.detach() - f32.detach()) + f32, loss / len(self.patch_nums)

    def next_input(self, scale: int, f_hat: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference step: add scale si's codes idx [B, pn^2] to f_hat [B, Cvae, H, W]; return (f_hat, the
        transformer's next-scale input [B, pn_{si+1}^2, Cvae], or None after the last scale)."""
        f_hat = f_hat + self.upsampled_residual(scale, idx)
        if scale == len(self.patch_nums) - 1:
            return f_hat, None
        pn = self.patch_nums[scale + 1]
        down = F.interpolate(f_hat, size=(pn, pn), mode="area")  # [B, C, pn, pn]
        return f_hat, down.flatten(2).transpose(1, 2)

    def scale_inputs(self, pyramid: Sequence[torch.Tensor], num_scales: int | None = None) -> torch.Tensor:
        """The transformer's inputs of scales 1..n-1 (n = num_scales, default all) from the codes of scales
        0..n-2: [B, sum of pn^2 over scales 1..n-1, Cvae] (empty for n = 1)."""
        n = len(self.patch_nums) if num_scales is None else num_scales
        check(1 <= n <= len(self.patch_nums) and len(pyramid) >= n - 1,
              f"scale_inputs needs 1 <= num_scales <= {len(self.patch_nums)} and the codes of the first "
              f"num_scales - 1 scales; got num_scales={n} and {len(pyramid)} scales of codes.")
        b, full = pyramid[0].shape[0], self.patch_nums[-1]
        f_hat = pyramid[0].new_zeros(b, self.cvae, full, full, dtype=torch.float32)
        inputs = [f_hat.new_zeros(b, 0, self.cvae)]
        for si in range(n - 1):
            f_hat, nxt = self.next_input(si, f_hat, pyramid[si])
            inputs.append(nxt)
        return torch.cat(inputs, 1)

    def teacher_inputs(self, pyramid: Sequence[torch.Tensor]) -> torch.Tensor:
        """The transformer's training inputs for scales 1.. from a full code pyramid: [B, L - pn_0^2, Cvae]."""
        return self.scale_inputs(pyramid)
