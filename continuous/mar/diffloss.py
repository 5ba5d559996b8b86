"""MAR's diffusion head: `SimpleMLPAdaLN` (a residual MLP with adaLN modulation from timestep + condition) and
`DiffLoss`, which trains it and samples one token per condition vector with classifier-free guidance on eps.

Parameter names follow the official module tree (`diffloss.net.res_blocks.{i}.adaLN_modulation.1`, ...), so
converted checkpoints load by name.

    head = DiffLoss(token_channels=16, z_channels=192, width=256, depth=3, num_sampling_steps=100)
    loss = head.loss(target [N, 16], z [N, 192], mask [N])
    trajectory = head.sample(z [2N, 192], x_T [N, 16], step_noise [S, N, 16], cfg=3.0, temperature=1.0)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from continuous.mar.diffusion import GaussianDiffusion, Trajectory


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """256-d sinusoidal embedding of the (original) timestep -> MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))
        self.frequency_embedding_size = frequency_embedding_size

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_embedding_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]  # [N, half]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], -1).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    """LN -> shift/scale from y -> Linear-SiLU-Linear -> gated residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.in_ln = nn.LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, channels))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 3 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    """DiT's final layer: non-affine LN, adaLN shift/scale, Linear to the 2C outputs (eps, variance)."""

    def __init__(self, channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(channels, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(channels, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 2 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """eps and variance predictor for one token: input_proj(x_t) through `depth` ResBlocks modulated by
    time_embed(t) + cond_embed(z)."""

    def __init__(self, in_channels: int, model_channels: int, out_channels: int, z_channels: int,
                 num_res_blocks: int) -> None:
        super().__init__()
        self.time_embed = TimestepEmbedder(model_channels)
        self.cond_embed = nn.Linear(z_channels, model_channels)
        self.input_proj = nn.Linear(in_channels, model_channels)
        self.res_blocks = nn.ModuleList([ResBlock(model_channels) for _ in range(num_res_blocks)])
        self.final_layer = FinalLayer(model_channels, out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        for layer in [b.adaLN_modulation[-1] for b in self.res_blocks] + [self.final_layer.adaLN_modulation[-1],
                                                                            self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x [N, C], t [N], c [N, Z] -> [N, 2C]."""
        return self.forward_modulated(x, self.time_embed(t) + self.cond_embed(c))

    def forward_modulated(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [N, C] with the modulation input y = time_embed(t) + cond_embed(c) [N, W] already computed."""
        x = self.input_proj(x)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)


class DiffLoss(nn.Module):
    """The diffusion head of a MAR: `net` plus the training and sampling diffusions (1000 training steps, cosine
    betas, eps prediction, learned-range variance; `num_sampling_steps` respaced steps for sampling)."""

    def __init__(self, token_channels: int, z_channels: int, width: int, depth: int,
                 num_sampling_steps: int = 100) -> None:
        super().__init__()
        self.in_channels = token_channels
        self.net = SimpleMLPAdaLN(token_channels, width, token_channels * 2, z_channels, depth)
        self.train_diffusion = GaussianDiffusion(num_sampling_steps)

    def diffusion(self, num_sampling_steps: int, spacing: str = "linspace") -> GaussianDiffusion:
        """The sampling diffusion with `num_sampling_steps` steps (cached per step count and spacing)."""
        cache = self.__dict__.setdefault("_diffusions", {})
        if (num_sampling_steps, spacing) not in cache:
            cache[num_sampling_steps, spacing] = GaussianDiffusion(num_sampling_steps, spacing=spacing)
        return cache[num_sampling_steps, spacing]

    def loss(self, target: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """Mean diffusion loss of tokens target [N, C] given conditions z [N, Z], over mask [N] (1 = counted)."""
        per_token = self.train_diffusion.training_loss(lambda x, t: self.net(x, t, z), target, generator)
        if mask is None:
            return per_token.mean()
        return (per_token * mask).sum() / mask.sum().clamp_min(1)

    def sample(self, z: torch.Tensor, x_t: torch.Tensor, step_noise: torch.Tensor, cfg: float | torch.Tensor = 1.0,
               temperature: float = 1.0, num_sampling_steps: int = 100, guided: bool = False,
               timestep_spacing: str = "linspace") -> Trajectory:
        """Denoise N tokens from x_T [N, C] with step_noise [S, N, C]. With `guided`, z is [2N, Z] (conditional
        rows, then unconditional ones), both halves share the noise and eps = eps_u + cfg (eps_c - eps_u) (cfg a
        number or [N, 1] per token); the variance is the conditional half's. timestep_spacing: see
        `continuous.mar.diffusion.respaced_timesteps`."""
        c = self.in_channels
        diffusion = self.diffusion(num_sampling_steps, timestep_spacing)
        # the condition's and every step's time embedding, computed once: [S, 1, W] + [R, W]
        cond_embedding = self.net.cond_embed(z)
        times = self.net.time_embed(diffusion.timesteps.to(z.device)).unsqueeze(1)

        def eps_fn(x: torch.Tensor, t: torch.Tensor, s: int) -> torch.Tensor:
            y = times[s] + cond_embedding  # [R, W]
            if not guided:
                return self.net.forward_modulated(x, y)
            out = self.net.forward_modulated(torch.cat([x, x]), y)  # [2N, 2C]
            cond, uncond = out.chunk(2)
            eps = uncond[:, :c] + cfg * (cond[:, :c] - uncond[:, :c])
            return torch.cat([eps, cond[:, c:]], -1)

        return diffusion.sample(eps_fn, x_t, step_noise, temperature)
