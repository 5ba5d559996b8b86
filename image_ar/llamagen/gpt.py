"""The LlamaGen GPT (FoundationVision/LlamaGen `autoregressive/models/gpt.py`) as a diffusers model.

A Llama-style decoder over VQ image tokens in raster order, conditioned on a class label (c2i, one condition
token) or on flan-t5-xl caption features (t2i, 120 condition tokens). Module names equal the official
state-dict keys, so official checkpoints load with (almost) no renaming (see `convert_gpt.py`).

Architecture (pre-norm, no biases anywhere):

    x = [cls_embedding(cond)  ;  tok_embeddings(image tokens)]                 # [B, C + S, dim]
    per layer:  h = x + wo(attn(2D-RoPE(wqkv(attention_norm(x)))))            # fused qkv, GQA
                x = h + w2(silu(w1(ffn_norm(h))) * w3(ffn_norm(h)))            # SwiGLU
    logits = output(norm(x)).float()                                          # [B, C + S, vocab]

- RMSNorm is computed in float32 and cast back (`x * rsqrt(mean(x^2) + eps)`, then `* weight`).
- SwiGLU hidden size: `find_multiple(int(ffn_dim_multiplier * int(2 * 4 * dim / 3)), multiple_of)`.
- 2D RoPE: see `rope.py`; condition positions get (cos, sin) = (0, 0), which zeroes q and k there (official).
- Dropout (training only): token dropout on the embeddings (condition included), residual dropout after `wo`,
  FFN dropout after `w2`, optional stochastic depth (drop path) on both residual branches; label dropout
  (`class_dropout_prob`) replaces the condition by the null class / unconditional caption for CFG training.
  The inference API (`forward_cached`, `prefill_condition`) never applies dropout, whatever the module's mode.
- c2i: `cls_embedding.embedding_table` has `num_classes + 1` rows when `class_dropout_prob > 0`; the last row
  (label `num_classes`) is the null class used for CFG.
- t2i: `cls_embedding.cap_proj` is Linear(caption_dim, dim) -> GELU(tanh) -> Linear(dim, dim), no biases;
  `cls_embedding.uncond_embedding` [cls_token_num, caption_dim] replaces dropped captions. Officially it is a
  registered BUFFER initialised to randn / sqrt(caption_dim), so it is saved but never trained; mirrored here.

Inference API (implements `mmspec.lm.CachedLM`; absolute positions: condition tokens occupy 0..C-1, image
token i sits at C + i; the KV cache holds the condition at slots 0..C-1):

    cond = model.embed_condition(labels, drop_mask=None)        # [B, C, dim]; drop_mask rows -> null condition
    cache = model.new_cache(batch_size, capacity)               # capacity >= C + block_size (+ draft slack)
    logits = model.prefill_condition(cond, cache)               # [B, V]: logits of the FIRST image token
    logits = model.forward_cached(tokens, positions, cache, slots, mask)   # [B, S, V]
    model.last_hidden                                           # [B, S, dim] final normed hidden states

`last_hidden` holds the output of the final `norm` (the features the `output` head reads) of the most recent
forward of any kind, detached; an EAGLE-style drafter takes its target features from it.

Training API: `model(idx, cond, targets)` teacher-forces [cond, idx[:, :-1]] with a full causal mask and
returns `LlamaGenGPTOutput(logits [B, T, V], loss)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from torch import nn

from image_ar.llamagen.rope import RopePositions, grid_size_of, rope_table_2d, rotate
from mmspec.attention import attend
from mmspec.attention.model_backend import AttentionBackendMixin
from mmspec.cache import StaticKVCache
from mmspec.errors import InputError, check, check_positive_int

# official sizes: name -> (n_layer, n_head, dim); parameter counts are for c2i, vocab 16384
PRESETS: dict[str, tuple[int, int, int]] = {
    "B": (12, 12, 768),  # 111M
    "L": (24, 16, 1024),  # 343M
    "XL": (36, 20, 1280),  # 775M
    "XXL": (48, 24, 1536),  # 1.4B
    "XXXL": (48, 40, 2560),  # 3.9B
    "1B": (22, 32, 2048),  # 1.2B (t2i family)
    "3B": (24, 32, 3200),  # 3.1B
    "7B": (32, 32, 4096),  # 6.6B (t2i family)
}
MODEL_TYPES = ("c2i", "t2i")


def find_multiple(n: int, k: int) -> int:
    """The smallest multiple of k that is >= n."""
    return n if n % k == 0 else n + k - (n % k)


def ffn_hidden_dim(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """The official SwiGLU hidden size: find_multiple(int(mult * int(2 * 4 * dim / 3)), multiple_of)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return find_multiple(hidden, multiple_of)


def preset_sizes(name: str) -> tuple[int, int, int]:
    """(n_layer, n_head, dim) of an official size; accepts 'B', 'gpt-b', 'GPT-B', ..."""
    key = name.upper().removeprefix("GPT-").removeprefix("GPT_") if isinstance(name, str) else None
    if key not in PRESETS:
        raise InputError(f"unknown LlamaGen preset {name!r}; known presets: {', '.join(PRESETS)}.")
    return PRESETS[key]


def preset_name_for(n_layer: int, dim: int) -> str | None:
    """The official size name with this depth and width, or None."""
    for name, (layers, _, width) in PRESETS.items():
        if (layers, width) == (n_layer, dim):
            return name
    return None


def _drop_path(x: torch.Tensor, prob: float, train: bool) -> torch.Tensor:
    """Stochastic depth per sample (timm's `drop_path`, scaled by the keep probability)."""
    if prob == 0.0 or not train:
        return x
    keep = 1.0 - prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)  # [B, 1, 1]
    return x * mask.div_(keep) if keep > 0 else x * mask


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """[1, L, L] bool lower-triangular mask (True = may attend)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril().unsqueeze(0)


def mask_condition_keys(mask: torch.Tensor, slots: torch.Tensor, cond_key_mask: torch.Tensor) -> torch.Tensor:
    """Hide padded condition keys, as the official t2i `emb_masks` do.

    mask [B|1, S, T] or [B, 1|H, S, T] bool; slots [B|1, S] the queries' own slots; cond_key_mask [B, C] bool,
    True = a real condition token at slot c. A key at a condition slot whose entry is False is hidden from every
    query except the query sitting at that slot (the official mask keeps the diagonal). Returns [B, (1,) S, T].
    """
    t = mask.shape[-1]
    hidden = F.pad(~cond_key_mask, (0, t - cond_key_mask.shape[1]), value=False)  # [B, T]
    own = torch.arange(t, device=mask.device) == slots.unsqueeze(-1)  # [B|1, S, T]
    keep = hidden.unsqueeze(1).logical_not() | own  # [B, S, T]
    return mask & (keep.unsqueeze(1) if mask.dim() == 4 else keep)


@dataclass
class LlamaGenGPTOutput(BaseOutput):
    """Training forward output: logits [B, T, V] (float32) and the mean cross-entropy (None without targets)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class LlamaGenKVCache(StaticKVCache):
    """`StaticKVCache` plus the per-row mask of real condition tokens (t2i captions with padding).

    `cond_key_mask` [B, C] bool (None = every condition token is real) is set by `prefill_condition` and applied
    by the model to every later `forward_cached`, so callers keep building masks with `attention_mask`.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cond_key_mask: torch.Tensor | None = None  # [B, C] bool

    def reset(self) -> None:
        super().reset()
        self.cond_key_mask = None

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        if self.cond_key_mask is not None:
            self.cond_key_mask = self.cond_key_mask.index_select(0, rows)


# ------------------------------------------------------------------------------------------------ modules
class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in float32, cast back to x's dtype, times `weight`."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # [..., dim]
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Fused-qkv grouped-query attention with 2D RoPE, through the mmspec attention registry."""

    def __init__(self, dim: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.q_size, self.kv_size = dim, n_kv_head * self.head_dim
        self.wqkv = nn.Linear(dim, self.q_size + 2 * self.kv_size, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor, cache: StaticKVCache | None,
                layer_index: int, slots: torch.Tensor | None, backend: str | None) -> torch.Tensor:
        b, s, _ = x.shape
        qk, v = self.wqkv(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = rotate(qk.view(b, s, self.n_head + self.n_kv_head, self.head_dim), rope)  # [B, S, H + Hkv, hd]
        q, k = qk.transpose(1, 2).split([self.n_head, self.n_kv_head], dim=1)  # [B, H, S, hd], [B, Hkv, S, hd]
        v = v.view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)  # [B, Hkv, S, hd]
        if cache is not None:
            k, v = cache.write(layer_index, slots, k, v)  # [B, Hkv, T, hd]
        out = attend(q, k, v, mask, backend=backend)  # [B, H, S, hd]
        return self.wo(out.transpose(1, 2).reshape(b, s, self.q_size))  # [B, S, dim]


class TransformerBlock(nn.Module):
    """Pre-norm block; dropout and drop path act only when `train` is True."""

    def __init__(self, dim: int, n_head: int, n_kv_head: int, hidden_dim: int, norm_eps: float,
                 resid_dropout_p: float, ffn_dropout_p: float, drop_path: float) -> None:
        super().__init__()
        self.attention = Attention(dim, n_head, n_kv_head)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.resid_dropout_p, self.ffn_dropout_p, self.drop_path = resid_dropout_p, ffn_dropout_p, drop_path

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor, *, cache: StaticKVCache | None = None,
                layer_index: int = 0, slots: torch.Tensor | None = None, backend: str | None = None,
                train: bool = False) -> torch.Tensor:
        a = self.attention(self.attention_norm(x), rope, mask, cache, layer_index, slots, backend)  # [B, S, dim]
        h = x + _drop_path(F.dropout(a, self.resid_dropout_p, train), self.drop_path, train)
        f = self.feed_forward(self.ffn_norm(h))  # [B, S, dim]
        return h + _drop_path(F.dropout(f, self.ffn_dropout_p, train), self.drop_path, train)


class LabelEmbedder(nn.Module):
    """Class label -> one condition token; row `num_classes` is the null class (present iff dropout > 0)."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.has_null = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + int(self.has_null), dim)

    def forward(self, labels: torch.Tensor, drop_mask: torch.Tensor | None) -> torch.Tensor:
        if drop_mask is not None:
            labels = torch.where(drop_mask, self.num_classes, labels)  # [B]
        return self.embedding_table(labels).unsqueeze(1)  # [B, 1, dim]


class CaptionMLP(nn.Module):
    """fc1 -> GELU(tanh) -> fc2, no biases (the official `MLP`)."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Caption features [B, C, caption_dim] -> condition tokens [B, C, dim]; dropped rows use uncond_embedding."""

    def __init__(self, caption_dim: int, dim: int, token_num: int) -> None:
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, caption: torch.Tensor, drop_mask: torch.Tensor | None) -> torch.Tensor:
        if drop_mask is not None:
            uncond = self.uncond_embedding.to(caption.dtype)  # [C, caption_dim]
            caption = torch.where(drop_mask[:, None, None], uncond, caption)  # [B, C, caption_dim]
        return self.cap_proj(caption)  # [B, C, dim]


def _check_config(vocab_size: int, dim: int, n_layer: int, n_head: int, n_kv_head: int | None, block_size: int,
                  cls_token_num: int, model_type: str, num_classes: int, caption_dim: int) -> None:
    for name, value in (("vocab_size", vocab_size), ("dim", dim), ("n_layer", n_layer), ("n_head", n_head),
                        ("cls_token_num", cls_token_num), ("num_classes", num_classes),
                        ("caption_dim", caption_dim)):
        check_positive_int(name, value)
    check(model_type in MODEL_TYPES, f"model_type must be one of {MODEL_TYPES}, got {model_type!r}.")
    check(dim % n_head == 0, f"dim ({dim}) must be divisible by n_head ({n_head}).")
    check(n_kv_head is None or (isinstance(n_kv_head, int) and n_kv_head >= 1 and n_head % n_kv_head == 0),
          f"n_kv_head must be None (= n_head) or a positive divisor of n_head ({n_head}), got {n_kv_head!r}.")
    check(model_type != "c2i" or cls_token_num == 1,
          f"c2i models have exactly one condition token; got cls_token_num={cls_token_num} (use 1).")
    grid_size_of(block_size)


def _check_rates(**rates: float) -> None:
    for name, value in rates.items():
        check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0,
              f"{name} must be a probability in [0, 1], got {value!r}.")


# -------------------------------------------------------------------------------------------------- model
class LlamaGenGPT(AttentionBackendMixin, RopePositions, ModelMixin, ConfigMixin):
    """LlamaGen's image-token transformer (c2i or t2i) at any size; see the module docstring."""

    attends_without_mask = True  # forward_cached takes mask None (`mmspec.lm.CachedLM`)

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 16384,
        dim: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        n_kv_head: int | None = None,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        rope_base: float = 10000.0,
        block_size: int = 256,
        cls_token_num: int = 1,
        model_type: str = "c2i",
        num_classes: int = 1000,
        caption_dim: int = 2048,
        class_dropout_prob: float = 0.1,
        token_dropout_p: float = 0.1,
        resid_dropout_p: float = 0.1,
        ffn_dropout_p: float = 0.1,
        drop_path_rate: float = 0.0,
        initializer_range: float = 0.02,
        attention_backend: str | None = None,
        default_guidance_scale: float | None = None,
    ) -> None:
        super().__init__()
        check(default_guidance_scale is None or (isinstance(default_guidance_scale, (int, float))
                                                 and default_guidance_scale >= 1),
              f"default_guidance_scale must be None or a number >= 1, got {default_guidance_scale!r}.")
        _check_config(vocab_size, dim, n_layer, n_head, n_kv_head, block_size, cls_token_num, model_type,
                      num_classes, caption_dim)
        check_positive_int("multiple_of", multiple_of)
        _check_rates(class_dropout_prob=class_dropout_prob, token_dropout_p=token_dropout_p,
                     resid_dropout_p=resid_dropout_p, ffn_dropout_p=ffn_dropout_p, drop_path_rate=drop_path_rate)
        self.vocab_size, self.dim, self.n_layer, self.n_head = vocab_size, dim, n_layer, n_head
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        self.head_dim = dim // n_head
        self.block_size, self.cls_token_num, self.model_type = block_size, cls_token_num, model_type
        self.num_classes, self.class_dropout_prob = num_classes, class_dropout_prob
        self.token_dropout_p, self.attention_backend = token_dropout_p, attention_backend
        self.check_positions = True  # forward_cached validates positions (one host sync); False to skip

        if model_type == "c2i":
            self.cls_embedding: nn.Module = LabelEmbedder(num_classes, dim, class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedder(caption_dim, dim, cls_token_num)
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        hidden = ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
        rates = torch.linspace(0, drop_path_rate, n_layer, device="cpu").tolist()
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_head, self.n_kv_head, hidden, norm_eps, resid_dropout_p, ffn_dropout_p, r)
            for r in rates
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        # float32, not a buffer (official files do not store it; `.to(dtype)` must not round it)
        self._rope = rope_table_2d(grid_size_of(block_size), self.head_dim, rope_base, cls_token_num)
        self.last_hidden: torch.Tensor | None = None  # [B, S, dim]
        self._init_weights(initializer_range)

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_preset(cls, name: str, **overrides) -> LlamaGenGPT:
        """An official size ('B', 'L', 'XL', 'XXL', 'XXXL', '1B', '3B', '7B'); other config args as overrides."""
        n_layer, n_head, dim = preset_sizes(name)
        return cls(**{"n_layer": n_layer, "n_head": n_head, "dim": dim, **overrides})

    def _init_weights(self, std: float) -> None:
        """Official init: N(0, std) for every Linear and Embedding weight, zeros for `output`."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        nn.init.zeros_(self.output.weight)

    # ---------------------------------------------------------------------------------------- conditions
    def embed_condition(self, cond: torch.Tensor, drop_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Condition tokens [B, cls_token_num, dim].

        c2i: cond = class labels [B] int in [0, num_classes] (num_classes = the null class). t2i: cond = caption
        features [B, cls_token_num, caption_dim]. drop_mask [B] bool: rows where True get the null class /
        the unconditional caption (the CFG branch, or label dropout).
        """
        if self.model_type == "c2i":
            self._check_labels(cond, drop_mask)
        else:
            self._check_caption(cond)
            cond = cond.to(self.tok_embeddings.weight.dtype)
        if drop_mask is not None:
            b = cond.shape[0]
            check(isinstance(drop_mask, torch.Tensor) and drop_mask.dtype == torch.bool
                  and tuple(drop_mask.shape) == (b,),
                  f"drop_mask must be a bool tensor [B] = [{b}] (True = use the null condition), got "
                  f"{getattr(drop_mask, 'dtype', type(drop_mask).__name__)} {list(getattr(drop_mask, 'shape', []))}.")
            drop_mask = drop_mask.to(cond.device)
        return self.cls_embedding(cond, drop_mask)  # [B, C, dim]

    def _check_labels(self, labels: torch.Tensor, drop_mask: torch.Tensor | None) -> None:
        check(isinstance(labels, torch.Tensor) and labels.dim() == 1 and not labels.is_floating_point()
              and labels.dtype != torch.bool,
              f"c2i condition must be integer class labels [B], got "
              f"{getattr(labels, 'dtype', type(labels).__name__)} {list(getattr(labels, 'shape', []))}.")
        has_null = self.cls_embedding.has_null
        top = self.num_classes if has_null else self.num_classes - 1
        check(drop_mask is None or has_null,
              "drop_mask needs a null class, but this model has class_dropout_prob=0 (no null row); "
              "build it with class_dropout_prob > 0.")
        if labels.numel() and bool(((labels < 0) | (labels > top)).any()):
            raise InputError(
                f"class labels must lie in [0, {top}] ({self.num_classes} classes"
                f"{', label ' + str(self.num_classes) + ' = null class' if has_null else ''}), got values in "
                f"[{int(labels.min())}, {int(labels.max())}]."
            )

    def _check_caption(self, caption: torch.Tensor) -> None:
        want = [self.cls_token_num, self.config.caption_dim]
        check(isinstance(caption, torch.Tensor) and caption.dim() == 3 and list(caption.shape[1:]) == want
              and caption.is_floating_point(),
              f"t2i condition must be float caption features [B, {want[0]}, {want[1]}] (cls_token_num, "
              f"caption_dim; pad or truncate captions to cls_token_num tokens), got "
              f"{getattr(caption, 'dtype', type(caption).__name__)} {list(getattr(caption, 'shape', []))}.")

    def _check_cond_mask(self, cond_mask: torch.Tensor | None, batch_size: int) -> None:
        if cond_mask is None:
            return
        want = (batch_size, self.cls_token_num)
        check(isinstance(cond_mask, torch.Tensor) and cond_mask.dtype == torch.bool and tuple(cond_mask.shape) == want,
              f"cond_mask must be a bool tensor {list(want)} (True = a real caption token, False = padding), got "
              f"{getattr(cond_mask, 'dtype', type(cond_mask).__name__)} {list(getattr(cond_mask, 'shape', []))}.")

    # ------------------------------------------------------------------------------------------ inference
    def new_cache(self, batch_size: int, capacity: int) -> LlamaGenKVCache:
        """An empty cache for `batch_size` rows (2B with CFG) of `capacity` entries (>= cls_token_num +
        block_size for a whole image; extra room for draft slots is fine)."""
        p = self.tok_embeddings.weight
        return LlamaGenKVCache(self.n_layer, batch_size, self.n_kv_head, capacity, self.head_dim, p.dtype, p.device)

    @torch.no_grad()
    def prefill_condition(self, cond_embeddings: torch.Tensor, cache: StaticKVCache,
                          cond_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the condition tokens [B, C, dim] at positions and slots 0..C-1 of an EMPTY cache, commit them,
        and return the logits [B, V] for the first image token (the output at the last condition position).

        cond_mask [B, C] bool (t2i, optional): False marks padded caption tokens; they are hidden from every
        later query (official `emb_masks`), which needs the cache from `new_cache`.
        """
        c = self.cls_token_num
        check(isinstance(cond_embeddings, torch.Tensor) and cond_embeddings.dim() == 3
              and list(cond_embeddings.shape[1:]) == [c, self.dim],
              f"cond_embeddings must be [B, {c}, {self.dim}] (from embed_condition), got "
              f"{list(getattr(cond_embeddings, 'shape', []))}.")
        b = cond_embeddings.shape[0]
        self._check_cache(cache, b)
        self._check_cond_mask(cond_mask, b)
        check(cache.capacity >= c, f"cache capacity {cache.capacity} < cls_token_num {c}; make a larger cache.")
        check(not bool(cache.lengths.any()), "prefill_condition needs an empty cache; call cache.reset() first.")
        if cond_mask is not None:
            check(isinstance(cache, LlamaGenKVCache),
                  "cond_mask needs the cache from model.new_cache (a LlamaGenKVCache), got a plain StaticKVCache.")
            cache.cond_key_mask = cond_mask.to(cache.device)
        slots = cache.slots(c)  # [B, C]
        x = cond_embeddings.to(self.tok_embeddings.weight.dtype)  # [B, C, dim]
        logits = self._run_cached(x, slots, cache, slots, cache.attention_mask(slots))  # [B, C, V]
        cache.commit_chain(torch.full_like(cache.lengths, c))
        return logits[:, -1]  # [B, V]

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Image tokens [B, S] at absolute positions [B, S] (image token i at cls_token_num + i), written to
        cache `slots` [B, S], attending through `mask` [B, S, T] (True = may attend; None: every key up to the
        cache's visible end, `mmspec.lm.CachedLM`). Returns logits [B, S, V]
        (float32) and sets `last_hidden` [B, S, dim]. Positions may be non-contiguous (tree drafts)."""
        check(isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and not tokens.is_floating_point(),
              f"tokens must be integer image tokens [B, S], got {list(getattr(tokens, 'shape', []))}.")
        b, s = tokens.shape
        self._check_cache(cache, b)
        for name, value in (("positions", positions), ("slots", slots)):
            check(isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] in (1, b)
                  and value.shape[1] == s and not value.is_floating_point(),
                  f"{name} must be an integer tensor [B, S] = [{b}, {s}], got {list(getattr(value, 'shape', []))}.")
        if mask is None and getattr(cache, "cond_key_mask", None) is not None:  # padded captions need a mask
            mask = cache.attention_mask(slots.expand(b, s))
        check(mask is None or isinstance(mask, torch.Tensor) and mask.dim() in (3, 4)
              and mask.shape[-2:] == (s, cache.num_keys),
              f"mask must be bool [B, S, T] = [{b}, {s}, {cache.num_keys}], got {list(getattr(mask, 'shape', []))}.")
        self._check_positions(positions)
        x = self.tok_embeddings(tokens)  # [B, S, dim]
        return self._run_cached(x, positions, cache, slots.expand(b, s), mask)

    def _check_cache(self, cache: StaticKVCache, batch_size: int) -> None:
        check(isinstance(cache, StaticKVCache), f"cache must come from model.new_cache, got {type(cache).__name__}.")
        want = (batch_size, self.n_kv_head, cache.capacity, self.head_dim)
        ok = len(cache.k) == self.n_layer and tuple(cache.k[0].shape) == want
        check(ok, f"cache does not fit this model/batch: {len(cache.k)} layers of {list(cache.k[0].shape)}, "
                  f"expected {self.n_layer} layers of {list(want)}; create it with model.new_cache(B, capacity).")

    def _check_positions(self, positions: torch.Tensor) -> None:
        if not self.check_positions or positions.numel() == 0:
            return
        n = self.max_seq_len
        if bool(((positions < 0) | (positions >= n)).any()):
            raise InputError(
                f"positions must lie in [0, {n}) (cls_token_num {self.cls_token_num} + block_size "
                f"{self.block_size}; image token i sits at {self.cls_token_num} + i), got values in "
                f"[{int(positions.min())}, {int(positions.max())}]. Do not draft past the last image token."
            )

    def _run_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, S, dim] at positions [B|1, S] -> logits [B, S, V]; K/V written at slots [B, S]."""
        cond_key_mask = getattr(cache, "cond_key_mask", None)
        if cond_key_mask is not None:
            mask = mask_condition_keys(mask, slots, cond_key_mask)  # [B, (1,) S, T]
        rope = self.rope_rows(positions)  # [B|1, S, 2, hd]
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, mask, cache=cache, layer_index=i, slots=slots, backend=self.attention_backend)
        h = self.norm(x)  # [B, S, dim]
        self.last_hidden = h.detach()
        return self.output(h).float()  # [B, S, V]

    # ------------------------------------------------------------------------------------------- training
    def forward(self, idx: torch.Tensor, cond: torch.Tensor, targets: torch.Tensor | None = None, *,
                cond_mask: torch.Tensor | None = None, drop_mask: torch.Tensor | None = None) -> LlamaGenGPTOutput:
        """Teacher-forced forward: logits [B, T, V] where position t predicts idx[:, t] from the condition and
        idx[:, :t] (input = [cond, idx[:, :-1]], full causal attention, no cache).

        idx [B, T] image tokens (T <= block_size); cond: labels [B] (c2i) or caption features [B, C, caption_dim]
        (t2i); targets [B, T] (usually idx) adds the mean cross-entropy; cond_mask [B, C] bool (t2i padding);
        drop_mask [B] bool forces the null condition on rows (like the official force_drop_ids). In training mode
        without drop_mask, each row's condition is dropped with probability class_dropout_prob.
        """
        check(isinstance(idx, torch.Tensor) and idx.dim() == 2 and 1 <= idx.shape[1] <= self.block_size
              and not idx.is_floating_point(),
              f"idx must be integer image tokens [B, T] with 1 <= T <= block_size ({self.block_size}), got "
              f"{list(getattr(idx, 'shape', []))}.")
        b, t = idx.shape
        check(isinstance(cond, torch.Tensor) and cond.dim() >= 1 and cond.shape[0] == b,
              f"cond must hold one condition per row of idx (batch {b}), got {list(getattr(cond, 'shape', []))}.")
        if targets is not None:
            check(isinstance(targets, torch.Tensor) and tuple(targets.shape) == (b, t),
                  f"targets must be [B, T] = [{b}, {t}], got {list(getattr(targets, 'shape', []))}.")
        self._check_cond_mask(cond_mask, b)
        if drop_mask is None and self.training and self.class_dropout_prob > 0:
            drop_mask = torch.rand(b, device=idx.device) < self.class_dropout_prob  # [B]
        x = torch.cat([self.embed_condition(cond, drop_mask), self.tok_embeddings(idx[:, :-1])], dim=1)
        x = F.dropout(x, self.token_dropout_p, self.training)  # [B, C + T - 1, dim]
        length = x.shape[1]
        positions = torch.arange(length, device=x.device)  # [L]
        mask = causal_mask(length, x.device)  # [1, L, L]
        if cond_mask is not None:
            mask = mask_condition_keys(mask, positions.unsqueeze(0), cond_mask)  # [B, L, L]
        rope = self.rope_rows(positions)  # [L, 2, hd]
        for layer in self.layers:
            x = layer(x, rope, mask, backend=self.attention_backend, train=self.training)
        h = self.norm(x)  # [B, L, dim]
        self.last_hidden = h.detach()
        logits = self.output(h).float()[:, self.cls_token_num - 1 :]  # [B, T, V]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return LlamaGenGPTOutput(logits=logits, loss=loss)
