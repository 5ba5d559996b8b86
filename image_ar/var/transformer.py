"""The VAR transformer (next-scale prediction) as a diffusers model: AdaLN blocks, L2-normalised Q/K with a
learnable per-head scale, block-causal attention over scales, per-scale KV caching in `mmspec.cache`.

Facts: VAR (arXiv 2404.02905; FoundationVision/VAR `models/var.py`). A depth-d model has width 64 d and d heads unless
the config says otherwise; `patch_nums` is the scale schedule (official: 1, 2, 3, 4, 5, 6, 8, 10, 13, 16 = 680 tokens;
any increasing schedule works, e.g. (1, 2, 4, 8) for a 32x32 world image with a 4x VQVAE). Parameter names follow the
official `var_d*.pth` state dicts (`blocks.{i}.attn.mat_qkv`, `q_bias`, `v_bias`, `scale_mul_1H11`,
`blocks.{i}.ada_lin.1`, `head_nm.ada_lin.1`, `pos_1LC`, `lvl_embed`, ...), so a converter only drops the official
buffers (`attn_bias_for_masking`, `lvl_1L`, `zero_k_bias`), which are recomputed here.

Glossary: a *scale* (level) si has pn_si x pn_si token positions; its *input* is the word embedding of the
area-downsampled running VQVAE feature f_hat (the class token map `sos + pos_start` for scale 0); the model
predicts the codes of scale si from the positions of scale si, attending to every position of scales <= si.

    model = VARTransformer(vocab_size=512, cvae=8, num_classes=16, depth=4, patch_nums=(1, 2, 4, 8))
    logits = model(labels, inputs_wo_first)                # teacher forcing: [B, L, V]
    cache = model.new_cache(batch_size=2 * B)               # inference, CFG as one 2B batch
    cond = model.condition(labels_2b)                       # [2B, C]
    logits0 = model.forward_cached(model.first_token_map(cond), cond, cache, first_scale=0)  # [2B, 1, V]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mmspec.attention import attend
from mmspec.attention.model_backend import AttentionBackendMixin
from mmspec.cache import StaticKVCache
from mmspec.errors import InputError, check, check_positive_int

MAX_SCALE_MUL = math.log(100.0)  # clamp of the learnable per-head attention scale (log space)


def scale_bounds(patch_nums: Sequence[int]) -> list[tuple[int, int]]:
    """[(begin, end)] of each scale's positions in the flattened token sequence."""
    bounds, cur = [], 0
    for pn in patch_nums:
        bounds.append((cur, cur + pn * pn))
        cur += pn * pn
    return bounds


def scale_levels(patch_nums: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """[L] the scale index of every position."""
    return torch.cat([torch.full((pn * pn,), i, device=device) for i, pn in enumerate(patch_nums)])


def check_patch_nums(patch_nums: Sequence[int]) -> tuple[int, ...]:
    pns = tuple(int(p) for p in patch_nums)
    check(len(pns) >= 1 and all(p >= 1 for p in pns) and all(a < b for a, b in zip(pns, pns[1:])),
          f"patch_nums must be a strictly increasing list of positive sizes, e.g. (1, 2, 4, 8); got {patch_nums!r}.")
    return pns


class VARSelfAttention(nn.Module):
    """Multi-head self-attention with VAR's biases (q and v only) and optional L2-normalised Q/K."""

    def __init__(self, embed_dim: int, num_heads: int, attn_l2_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.attn_l2_norm = attn_l2_norm
        if attn_l2_norm:
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), 4.0).log())
        self.mat_qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(embed_dim))
        self.v_bias = nn.Parameter(torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attention_backend: str | None = None  # None: attend's default (`VARTransformer.set_attention_backend`)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: StaticKVCache | None = None,
                layer: int = 0, slots: torch.Tensor | None = None) -> torch.Tensor:
        b, s, c = x.shape  # x [B, S, C]
        bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])  # [3C]
        qkv = F.linear(x, self.mat_qkv.weight, bias).view(b, s, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, hd]
        if self.attn_l2_norm:
            q = F.normalize(q, dim=-1) * self.scale_mul_1H11.clamp_max(MAX_SCALE_MUL).exp()
            k = F.normalize(k, dim=-1)
            scale = 1.0
        else:
            scale = 0.25 / math.sqrt(self.head_dim)
        if cache is not None:
            k, v = cache.write(layer, slots, k, v)  # [B, H, T, hd]
        out = attend(q, k, v, mask, backend=self.attention_backend, scale=scale)  # [B, H, S, hd]
        return self.proj(out.transpose(1, 2).reshape(b, s, c))


class VARFFN(nn.Module):
    def __init__(self, embed_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class AdaLNSelfAttn(nn.Module):
    """x + gamma1 * attn(LN(x) (1 + scale1) + shift1); x + gamma2 * ffn(LN(x) (1 + scale2) + shift2), the six
    modulations from the class condition (own `ada_lin`, or the model's shared one plus `ada_gss`)."""

    def __init__(self, embed_dim: int, num_heads: int, mlp_ratio: float, norm_eps: float, shared_aln: bool,
                 attn_l2_norm: bool, drop_path: float) -> None:
        super().__init__()
        self.embed_dim, self.drop_path = embed_dim, drop_path
        self.attn = VARSelfAttention(embed_dim, num_heads, attn_l2_norm)
        self.ffn = VARFFN(embed_dim, round(embed_dim * mlp_ratio))
        self.ln_wo_grad = nn.LayerNorm(embed_dim, eps=norm_eps, elementwise_affine=False)
        self.shared_aln = shared_aln
        if shared_aln:
            self.ada_gss = nn.Parameter(torch.randn(1, 1, 6, embed_dim) / embed_dim**0.5)
        else:
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(embed_dim, 6 * embed_dim))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """Stochastic depth (training only): drop the residual branch per sample."""
        if not self.training or self.drop_path <= 0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, device=x.device) >= self.drop_path
        return x * keep / (1 - self.drop_path)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mask: torch.Tensor | None,
                cache: StaticKVCache | None = None, layer: int = 0, slots: torch.Tensor | None = None) -> torch.Tensor:
        if self.shared_aln:  # cond: [B, 1, 6, C] from the model's shared_ada_lin
            mods = (self.ada_gss + cond).unbind(2)
        else:  # cond: [B, C]
            mods = self.ada_lin(cond).view(-1, 1, 6, self.embed_dim).unbind(2)
        gamma1, gamma2, scale1, scale2, shift1, shift2 = mods  # each [B, 1, C]
        h = self.attn(self.ln_wo_grad(x) * (scale1 + 1) + shift1, mask, cache, layer, slots)
        x = x + self._drop(h * gamma1)
        return x + self._drop(self.ffn(self.ln_wo_grad(x) * (scale2 + 1) + shift2) * gamma2)


class AdaLNBeforeHead(nn.Module):
    def __init__(self, embed_dim: int, norm_eps: float) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.ln_wo_grad = nn.LayerNorm(embed_dim, eps=norm_eps, elementwise_affine=False)
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(embed_dim, 2 * embed_dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada_lin(cond).view(-1, 1, 2, self.embed_dim).unbind(2)  # each [B, 1, C]
        return self.ln_wo_grad(x) * (scale + 1) + shift


class SharedAdaLin(nn.Linear):
    def forward(self, cond: torch.Tensor) -> torch.Tensor:
        return super().forward(cond).view(-1, 1, 6, self.weight.shape[0] // 6)  # [B, 1, 6, C]


class VARTransformer(AttentionBackendMixin, ModelMixin, ConfigMixin):
    """VAR's class-conditional next-scale transformer (see the module docstring)."""

    _keep_in_fp32_modules = ["head_nm", "head"]  # the official head runs in float32 (`logits`)

    @register_to_config
    def __init__(self, vocab_size: int = 4096, cvae: int = 32, num_classes: int = 1000, depth: int = 16,
                 embed_dim: int | None = None, num_heads: int | None = None, mlp_ratio: float = 4.0,
                 norm_eps: float = 1e-6, shared_aln: bool = False, cond_drop_rate: float = 0.1,
                 attn_l2_norm: bool = True, drop_path_rate: float = 0.0,
                 patch_nums: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("cvae", cvae), ("num_classes", num_classes),
                            ("depth", depth)):
            check_positive_int(name, value)
        c = 64 * depth if embed_dim is None else embed_dim
        heads = depth if num_heads is None else num_heads
        check_positive_int("embed_dim", c)
        check_positive_int("num_heads", heads)
        if c % heads:
            raise InputError(f"embed_dim ({c}) must be divisible by num_heads ({heads}).")
        self.patch_nums = check_patch_nums(patch_nums)
        self.bounds = scale_bounds(self.patch_nums)
        self.num_tokens = self.bounds[-1][1]  # L
        self.first_l = self.patch_nums[0] ** 2
        self.embed_dim, self.num_heads, self.depth = c, heads, depth
        init_std = math.sqrt(1 / c / 3)

        self.word_embed = nn.Linear(cvae, c)
        self.class_emb = nn.Embedding(num_classes + 1, c)  # row num_classes = the null class (CFG)
        self.pos_start = nn.Parameter(torch.empty(1, self.first_l, c))
        self.pos_1LC = nn.Parameter(torch.empty(1, self.num_tokens, c))
        self.lvl_embed = nn.Embedding(len(self.patch_nums), c)
        for tensor in (self.class_emb.weight, self.pos_start, self.pos_1LC, self.lvl_embed.weight):
            nn.init.trunc_normal_(tensor.data, mean=0, std=init_std)
        self.shared_ada_lin = nn.Sequential(nn.SiLU(), SharedAdaLin(c, 6 * c)) if shared_aln else nn.Identity()
        rates = [drop_path_rate * i / (depth - 1) if depth > 1 else 0.0 for i in range(depth)]  # linear, 0 first
        self.blocks = nn.ModuleList([AdaLNSelfAttn(c, heads, mlp_ratio, norm_eps, shared_aln, attn_l2_norm, rates[i])
                                     for i in range(depth)])
        self.head_nm = AdaLNBeforeHead(c, norm_eps)
        self.head = nn.Linear(c, vocab_size)
        self.attention_backend: str | None = None  # every block's too (`set_attention_backend`)
        self.register_buffer("levels", scale_levels(self.patch_nums), persistent=False)  # [L]

    # ----------------------------------------------------------------------------------------- inputs
    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """Class embeddings [B, C] of labels [B] (num_classes = the null class)."""
        return self.class_emb(labels)

    def level_positions(self, begin: int, end: int) -> torch.Tensor:
        """lvl_embed + pos_1LC for positions [begin, end): [1, end - begin, C]."""
        return self.lvl_embed(self.levels[begin:end]).unsqueeze(0) + self.pos_1LC[:, begin:end]

    def first_token_map(self, cond: torch.Tensor) -> torch.Tensor:
        """Scale 0's input: sos (the class embedding) + pos_start + level/position embeddings [B, first_l, C]."""
        return cond.unsqueeze(1) + self.pos_start + self.level_positions(0, self.first_l)

    def embed_inputs(self, features: torch.Tensor, begin: int) -> torch.Tensor:
        """word_embed of next-scale inputs features [B, l, Cvae] placed at positions [begin, begin + l)."""
        features = features.to(self.word_embed.weight.dtype)  # the quantizer's float32 features
        return self.word_embed(features) + self.level_positions(begin, begin + features.shape[1])

    def _modulation(self, cond: torch.Tensor) -> torch.Tensor:
        return self.shared_ada_lin(cond)  # [B, C], or [B, 1, 6, C] with shared AdaLN

    def logits(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Head over hidden states h [B, l, C] -> float32 logits [B, l, V], computed in the head's dtype (float32
        as the official code's autocast leaves it, unless the whole model was cast)."""
        dtype = self.head.weight.dtype
        return self.head(self.head_nm(h.to(dtype), cond.to(dtype))).float()

    # ------------------------------------------------------------------------------------- teacher forcing
    def forward(self, labels: torch.Tensor, inputs_wo_first: torch.Tensor,
                drop_condition: bool | None = None) -> torch.Tensor:
        """Training forward: labels [B], the next-scale inputs of scales 1.. [B, L - first_l, Cvae] ->
        logits [B, L, V] under the block-causal mask. `drop_condition` (default: in training) replaces labels by
        the null class with probability cond_drop_rate."""
        b = labels.shape[0]
        check(inputs_wo_first.shape[1] == self.num_tokens - self.first_l,
              f"inputs_wo_first must hold {self.num_tokens - self.first_l} positions (scales 1..), got "
              f"{inputs_wo_first.shape[1]}.")
        if self.training if drop_condition is None else drop_condition:
            drop = torch.rand(b, device=labels.device) < self.config.cond_drop_rate
            labels = torch.where(drop, torch.full_like(labels, self.config.num_classes), labels)
        cond = self.condition(labels)  # [B, C]
        h = torch.cat([self.first_token_map(cond), self.embed_inputs(inputs_wo_first, self.first_l)], dim=1)
        mask = self.levels.unsqueeze(0) <= self.levels.unsqueeze(1)  # [L, L] key scale <= query scale
        mod = self._modulation(cond)
        for block in self.blocks:
            h = block(h, mod, mask.expand(b, -1, -1))
        return self.logits(h, cond)

    # ------------------------------------------------------------------------------------------ inference
    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, num_scales: int | None = None) -> StaticKVCache:
        """A KV cache for every position of the first `num_scales` scales (default all) of `batch_size` rows
        (2B with CFG), in the model's dtype unless `dtype` is given. CoDe's drafter only needs its N scales, which
        is where its memory saving starts."""
        n = len(self.patch_nums) if num_scales is None else num_scales
        check(isinstance(n, int) and 1 <= n <= len(self.patch_nums),
              f"num_scales must be an integer in [1, {len(self.patch_nums)}], got {num_scales!r}.")
        return StaticKVCache(self.depth, batch_size, self.num_heads, self.bounds[n - 1][1],
                             self.embed_dim // self.num_heads, dtype=self.pos_1LC.dtype if dtype is None else dtype,
                             device=self.pos_1LC.device if device is None else device)

    def forward_cached(self, h: torch.Tensor, cond: torch.Tensor, cache: StaticKVCache,
                       first_scale: int) -> torch.Tensor:
        """Run embedded inputs h [B, l, C] of one or more consecutive whole scales starting at `first_scale`
        through the blocks, appending their keys and values to `cache` (all rows hold the same scales), and
        return logits [B, l, V]. Several scales at once (CoDe's hand-over prefill) attend block-causally."""
        begin = self.bounds[first_scale][0]
        levels = self.levels[begin:begin + h.shape[1]]  # [l]
        slots = cache.slots(h.shape[1])  # [B, l]
        block_mask = (levels.unsqueeze(0) <= levels.unsqueeze(1)).expand(h.shape[0], -1, -1)  # [B, l, l]
        mask = cache.attention_mask(slots, block_mask)  # [B, l, T]
        mod = self._modulation(cond)
        for i, block in enumerate(self.blocks):
            h = block(h, mod, mask, cache, i, slots)
        cache.commit_chain(torch.full_like(cache.lengths, h.shape[1]))
        return self.logits(h, cond)
