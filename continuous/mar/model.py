"""The MAR model (masked autoregressive image generation with continuous tokens) as a diffusers model: an
MAE-style encoder and decoder of timm `Block`s, buffer tokens holding the class embedding, and the `DiffLoss`
diffusion head that samples each token from the decoder's output at its position.

Facts: MAR (arXiv 2406.11838; LTH14/mar `models/mar.py`). Parameter names follow the official module tree (`z_proj`,
`z_proj_ln`, `class_emb`, `fake_latent`, `encoder_pos_embed_learned`, `encoder_blocks.{i}.attn.qkv`, `decoder_embed`,
`mask_token`, `decoder_pos_embed_learned`, `diffusion_pos_embed_learned`, `diffloss.net...`), so the official
`checkpoint-last.pth` loads by name. `timestep_spacing` is the sampler's step placement ("linspace",
the official default, or "leading"; see `continuous.mar.diffusion.respaced_timesteps`). `default_guidance_scale` and
`default_cfg_schedule` are the sampling settings a pipeline call uses when it leaves them unset (official: 3.0,
"linear"; the world models ship 2.0, "constant": docs/mar.md). Sizes: base 12/12 x 768
(DiffLoss d6 w1024), large 16/16 x 1024 (d8 w1280), huge 20/20 x 1280 (d12 w1536); any size from the config.

Glossary: *tokens* [B, L, C] are VAE latents, patchified (C = vae_embed_dim x patch_size^2); *known* [B, L] marks the
tokens generated so far (the encoder sees only those, plus the buffer); the decoder refills the others with the
mask token and predicts every position; *z* [B, L, D] are the diffusion head's conditions. Rows may know different
numbers of tokens (CSpD's ragged acceptance): the encoder then packs each row's known tokens and pads with a key
mask, which equals MAR's sparse encoder row by row.

    model = MARModel(img_size=32, vae_stride=4, encoder_depth=4, decoder_depth=4, embed_dim=192, num_heads=6)
    z = model.predict(tokens, known, model.condition(labels))     # [B, L, D]
"""

from __future__ import annotations

from functools import partial

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from timm.models.vision_transformer import Block
from torch import nn

from continuous.mar.diffloss import DiffLoss
from continuous.mar.diffusion import TIMESTEP_SPACINGS
from mmspec.attention.model_backend import FixedAttentionMixin
from mmspec.errors import check

CFG_SCHEDULES = ("linear", "constant")  # MAR's cfg_schedule options (official `sample_tokens`)


class MARModel(FixedAttentionMixin, ModelMixin, ConfigMixin):
    """MAR with its diffusion head (see the module docstring). The null class (index num_classes) is the learned
    `fake_latent` (CFG's unconditional rows)."""

    attention_owner = "timm's attention blocks (torch scaled_dot_product_attention)"

    @register_to_config
    def __init__(self, img_size: int = 256, vae_stride: int = 16, patch_size: int = 1, vae_embed_dim: int = 16,
                 embed_dim: int = 768, num_heads: int = 12, encoder_depth: int = 12, decoder_depth: int = 12,
                 decoder_embed_dim: int | None = None, decoder_num_heads: int | None = None, mlp_ratio: float = 4.0,
                 num_classes: int = 1000, buffer_size: int = 64, label_drop_prob: float = 0.1,
                 mask_ratio_min: float = 0.7, attn_dropout: float = 0.1, proj_dropout: float = 0.1,
                 diffloss_d: int = 6, diffloss_w: int = 1024, num_sampling_steps: int = 100,
                 diffusion_batch_mul: int = 4, timestep_spacing: str = "linspace",
                 pos_embed_init: str = "normal", default_guidance_scale: float = 3.0,
                 default_cfg_schedule: str = "linear") -> None:
        super().__init__()
        check(timestep_spacing in TIMESTEP_SPACINGS,
              f"timestep_spacing must be one of {TIMESTEP_SPACINGS}, got {timestep_spacing!r}.")
        check(isinstance(default_guidance_scale, (int, float)) and default_guidance_scale >= 1.0,
              f"default_guidance_scale must be a number >= 1.0, got {default_guidance_scale!r}.")
        check(default_cfg_schedule in CFG_SCHEDULES,
              f"default_cfg_schedule must be one of {CFG_SCHEDULES}, got {default_cfg_schedule!r}.")
        check(pos_embed_init in ("normal", "sincos"),
              f"pos_embed_init must be 'normal' or 'sincos', got {pos_embed_init!r}.")
        check(img_size % (vae_stride * patch_size) == 0,
              f"img_size {img_size} must be a multiple of vae_stride x patch_size ({vae_stride * patch_size}).")
        dec_dim = decoder_embed_dim or embed_dim
        dec_heads = decoder_num_heads or num_heads
        self.seq_side = img_size // vae_stride // patch_size
        self.seq_len = self.seq_side ** 2
        self.token_channels = vae_embed_dim * patch_size ** 2

        def blocks(width: int, heads: int, depth: int) -> nn.ModuleList:
            return nn.ModuleList([Block(width, heads, mlp_ratio, qkv_bias=True, proj_drop=proj_dropout,
                                        attn_drop=attn_dropout, norm_layer=partial(nn.LayerNorm, eps=1e-6))
                                  for _ in range(depth)])

        self.class_emb = nn.Embedding(num_classes, embed_dim)
        self.fake_latent = nn.Parameter(torch.zeros(1, embed_dim))
        self.z_proj = nn.Linear(self.token_channels, embed_dim)
        self.z_proj_ln = nn.LayerNorm(embed_dim, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, embed_dim))
        self.encoder_blocks = blocks(embed_dim, num_heads, encoder_depth)
        self.encoder_norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.decoder_embed = nn.Linear(embed_dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + buffer_size, dec_dim))
        self.decoder_blocks = blocks(dec_dim, dec_heads, decoder_depth)
        self.decoder_norm = nn.LayerNorm(dec_dim, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len, dec_dim))
        self._initialize_weights()
        if pos_embed_init == "sincos":
            self._sincos_position_embeddings()
        self.diffloss = DiffLoss(self.token_channels, dec_dim, diffloss_w, diffloss_d, num_sampling_steps)

    def _initialize_weights(self) -> None:
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @torch.no_grad()
    def _sincos_position_embeddings(self) -> None:
        """Start the three learned position embeddings from MAE's fixed 2D sin-cos table at the token positions
        (buffer positions keep their normal init): spatial neighbourhoods are then visible from the first step."""
        for param in (self.encoder_pos_embed_learned, self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            param[0, -self.seq_len:] = sincos_2d(param.shape[-1], self.seq_side).to(param.dtype)

    # -------------------------------------------------------------------------------------------- tokens
    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents [B, c, h, w] -> tokens [B, L, c p^2] in raster order."""
        b, c, h, w = latents.shape
        p = self.config.patch_size
        x = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, L, c p^2] -> VAE latents [B, c, h, w]."""
        b, p, c, s = tokens.shape[0], self.config.patch_size, self.config.vae_embed_dim, self.seq_side
        x = tokens.reshape(b, s, s, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, s * p, s * p)

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """Class embeddings [B, D] of labels [B]; the null class (num_classes) is `fake_latent`."""
        null = labels == self.config.num_classes
        emb = self.class_emb(labels.clamp_max(self.config.num_classes - 1))
        return torch.where(null.unsqueeze(-1), self.fake_latent.to(emb.dtype), emb)

    # ------------------------------------------------------------------------------------------- forward
    def predict(self, tokens: torch.Tensor, known: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """The diffusion head's conditions z [B, L, D] of every position, given tokens [B, L, C], which of them
        are known [B, L] (bool) and the class embeddings [B, D] that fill the buffer."""
        b = tokens.shape[0]
        buf = self.config.buffer_size
        x = self.z_proj(tokens)  # [B, L, E]
        x = torch.cat([condition.unsqueeze(1).expand(b, buf, -1).to(x.dtype), x], 1) + self.encoder_pos_embed_learned
        x = self.z_proj_ln(x)  # [B, N, E], N = buf + L
        keep = torch.cat([known.new_ones(b, buf), known.bool()], 1)  # [B, N]
        counts = keep.sum(1)  # [B]
        width = int(counts.max())  # one host sync per forward
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]  # [B, K] kept positions first
        packed = x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [B, K, E]
        valid = torch.arange(width, device=x.device) < counts.unsqueeze(1)  # [B, K]
        ragged = bool((counts != width).any())
        attn_mask = None
        if ragged:  # padded keys take no part: [B, 1, 1, K] additive
            attn_mask = torch.zeros(valid.shape, dtype=x.dtype, device=x.device).masked_fill(~valid, float("-inf"))
            attn_mask = attn_mask[:, None, None, :]
        for block in self.encoder_blocks:
            packed = block(packed, attn_mask=attn_mask)
        packed = self.decoder_embed(self.encoder_norm(packed))  # [B, K, Dd]
        mask_token = self.mask_token.to(packed.dtype)
        packed = torch.where(valid.unsqueeze(-1), packed, mask_token)
        full = mask_token.expand(b, keep.shape[1], -1).clone()  # [B, N, Dd]
        full = full.scatter(1, index.unsqueeze(-1).expand(-1, -1, full.shape[-1]), packed)
        full = full + self.decoder_pos_embed_learned
        for block in self.decoder_blocks:
            full = block(full)
        return self.decoder_norm(full)[:, buf:] + self.diffusion_pos_embed_learned  # [B, L, Dd]

    def forward(self, tokens: torch.Tensor, known: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """z [B, L, D] for labels [B] (null class = num_classes)."""
        return self.predict(tokens, known, self.condition(labels))

    def random_mask(self, batch: int, mask_rate: float | None = None, generator: torch.Generator | None = None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """masked [B, L] (bool) of MAR training: a random order per row, its first ceil(L x rate) positions masked
        (rate from the truncated normal on [mask_ratio_min, 1] centred at 1, std 0.25, unless given)."""
        seq = self.seq_len
        if mask_rate is None:
            mask_rate = truncated_mask_rate(self.config.mask_ratio_min, generator)
        num_masked = max(1, min(seq, int(-(-seq * mask_rate // 1))))
        orders = torch.argsort(torch.rand(batch, seq, generator=generator), 1).to(device)  # [B, L]
        masked = torch.zeros(batch, seq, dtype=torch.bool, device=device)
        return masked.scatter_(1, orders[:, :num_masked], True)

    def training_loss(self, tokens: torch.Tensor, labels: torch.Tensor, generator: torch.Generator | None = None,
                      mask_rate: float | None = None) -> torch.Tensor:
        """MAR's training loss on clean tokens [B, L, C]: `random_mask` positions masked, the diffusion loss of the
        masked tokens repeated `diffusion_batch_mul` times. Labels are used as given (drop them to the null class
        beforehand for CFG training)."""
        b, seq, _ = tokens.shape
        masked = self.random_mask(b, mask_rate, generator, tokens.device)
        z = self.forward(tokens, ~masked, labels)  # [B, L, D]
        mul = self.config.diffusion_batch_mul
        return self.diffloss.loss(tokens.reshape(b * seq, -1).repeat(mul, 1), z.reshape(b * seq, -1).repeat(mul, 1),
                                  masked.reshape(-1).float().repeat(mul), generator)


def sincos_2d(dim: int, side: int) -> torch.Tensor:
    """MAE's 2D sin-cos position table [side^2, dim] (half the channels for rows, half for columns)."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)  # [dim/4]
    grid = torch.arange(side, dtype=torch.float64)
    rows, cols = torch.meshgrid(grid, grid, indexing="ij")
    parts = []
    for coord in (rows.flatten(), cols.flatten()):
        angles = coord[:, None] * omega[None]  # [L, dim/4]
        parts += [torch.sin(angles), torch.cos(angles)]
    table = torch.cat(parts, 1)  # [L, 4 (dim/4)]
    return torch.nn.functional.pad(table, (0, dim - table.shape[1])).float()


def cosine_mask_rate(generator: torch.Generator | None = None) -> float:
    """A masking rate cos(pi/2 u), u ~ U(0, 1) (MaskGIT's schedule): covers the context-rich late steps of
    generation that MAR's truncated normal on [0.7, 1] leaves out."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return float(torch.cos(torch.pi / 2 * u))


def truncated_mask_rate(minimum: float, generator: torch.Generator | None = None) -> float:
    """A masking rate from N(1, 0.25) truncated to [minimum, 1] (MAR's training distribution), by inverting the
    truncated CDF: 1 + 0.25 ndtri(ndtr(a) + u (ndtr(0) - ndtr(a))) with a = (minimum - 1) / 0.25."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    low = torch.special.ndtr(torch.tensor((minimum - 1.0) / 0.25, dtype=torch.float64))
    return float(1.0 + 0.25 * torch.special.ndtri(low + u * (0.5 - low)))
