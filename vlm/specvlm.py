"""SpecVLM: EagleVLM with an elastic visual compressor chosen per input by a question-aware gate, trained by online
logit distillation (from the SpecVLM paper and reference/vlm.md).

The compressor offers five primitives over a row's image run (T = g x g input embeddings, the target's projected
vision features), each giving a different number of tokens:

| primitive   | tokens      | what it does                                                                      |
|-------------|-------------|-----------------------------------------------------------------------------------|
| `prune`     | T / ratio   | keeps the T / ratio tokens of largest L2 norm (token drop), in their order        |
| `pool`      | T / ratio   | 2D average pooling over the grid (kernel and stride sqrt(ratio))                   |
| `conv`      | T / ratio   | a learned 2D convolution (kernel and stride sqrt(ratio))                           |
| `resample`  | 2           | a 1-layer Q-former: 2 learned queries cross-attending to the run (best at 2)       |
| `text_only` | 0           | drops every vision token                                                          |

The default "select" variant: a gate reads the target's features of the question (the mean of the final normed
hidden states over the prompt's text after the image: the target's own view of what is asked) and picks ONE
primitive per input: Gumbel-softmax with the straight-through estimator in training (hard one-hot forward,
soft gradient), argmax at inference. The chosen primitive's K tokens sit at the run's last K positions (later
text keeps its true positions), each paired with the target feature before its position, like any element.

Online logit distillation: the target (teacher) runs on every training batch, and the drafter learns its
features and distribution: 1.0 * SmoothL1(draft features, teacher features) + 0.1 * CE(draft logits, teacher
logits) (`mmspec.feature_drafter.feature_drafter_loss`; "penultimate features" = the final normed hidden
state that feeds the LM head). Not implemented: the "weighted fusion" and "concat" variants.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.errors import check
from mmspec.feature_drafter import PendingPairs
from mmspec.loop import DecodeState
from vlm.eagle import SPECVLM_TREE, VLMEagleDrafter, VLMEagleTreeDrafter
from vlm.target import VLMInputs

PRIMITIVES = ("prune", "pool", "conv", "resample", "text_only")


class QueryResampler(nn.Module):
    """SpecVLM's `resample` primitive: a 1-layer Q-former, `num_queries` learned queries (init N(0, H^-1/2))
    through a query projection cross-attending (one multi-head attention, no RoPE) to the image embeddings."""

    def __init__(self, hidden_size: int, num_queries: int = 2, num_heads: int = 4) -> None:
        super().__init__()
        check(hidden_size % num_heads == 0, f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}.")
        self.num_heads = num_heads
        self.queries = nn.Parameter(torch.randn(num_queries, hidden_size) * hidden_size ** -0.5)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden_size, hidden_size) for _ in range(4))

    def forward(self, image_embeds: torch.Tensor) -> torch.Tensor:
        """image_embeds [N, T, H] -> [N, num_queries, H]."""
        n, t, h = image_embeds.shape
        d = h // self.num_heads
        q = self.q_proj(self.queries.to(image_embeds.dtype)).view(1, -1, self.num_heads, d).transpose(1, 2)
        k = self.k_proj(image_embeds).view(n, t, self.num_heads, d).transpose(1, 2)  # [N, heads, T, d]
        v = self.v_proj(image_embeds).view(n, t, self.num_heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.expand(n, -1, -1, -1), k, v)  # [N, heads, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(n, -1, h))


class ElasticCompressor(nn.Module):
    """The five compression primitives (see the module docstring) over image runs [N, T, H], T = grid^2."""

    def __init__(self, hidden_size: int, grid: int, ratio: int = 4, num_queries: int = 2, heads: int = 4) -> None:
        super().__init__()
        side = math.isqrt(ratio)
        check(side * side == ratio and grid % side == 0,
              f"ratio {ratio} must be a square whose root divides the {grid}x{grid} image grid.")
        self.grid, self.ratio, self.side = grid, ratio, side
        self.conv = nn.Conv2d(hidden_size, hidden_size, kernel_size=side, stride=side)
        self.resampler = QueryResampler(hidden_size, num_queries, heads)
        self.sizes = [grid * grid // ratio] * 3 + [num_queries, 0]  # tokens per primitive

    def sizes_tensor(self) -> torch.Tensor:
        return torch.tensor(self.sizes)

    def forward(self, image: torch.Tensor) -> list[torch.Tensor]:
        """image [N, T, H] -> one [N, K_k, H] tensor per primitive (PRIMITIVES order)."""
        n, t, h = image.shape
        check(t == self.grid * self.grid,
              f"the compressor was built for {self.grid}x{self.grid} image tokens, got {t}.")
        keep = image.norm(dim=-1).topk(self.sizes[0], dim=-1).indices.sort(dim=-1).values  # [N, K]
        pruned = image.gather(1, keep.unsqueeze(-1).expand(-1, -1, h))
        grid = image.transpose(1, 2).reshape(n, h, self.grid, self.grid)  # [N, H, g, g]
        pooled = F.avg_pool2d(grid, self.side).flatten(2).transpose(1, 2)
        conv = self.conv(grid).flatten(2).transpose(1, 2)
        return [pruned, pooled, conv, self.resampler(image), image[:, :0]]


class VLMSpecVLMDrafter(VLMEagleDrafter):
    """EagleVLM + elastic compressor + question-aware gate (see the module docstring); layer 0 keeps its input
    norm by default (SpecVLM's EagleVLM adds it)."""

    official_tree = SPECVLM_TREE

    def image_tokens_attended(self, num_image_tokens: int) -> float:
        """The compressed size the gate chose (the last batch's rows averaged)."""
        return float(self.compressor.sizes_tensor()[self.last_choice].float().mean())

    @register_to_config
    def __init__(self, hidden_size: int = 4096, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 intermediate_size: int = 11008, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 4096, vocab_size: int = 32064, input_norm: bool = True,
                 fc_bias: bool = True, attention_backend: str | None = None, image_grid: int = 24,
                 compression_ratio: int = 4, resampler_queries: int = 2, gate_temperature: float = 1.0) -> None:
        super().__init__(hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps,
                         rope_theta, max_position_embeddings, vocab_size, input_norm, fc_bias, attention_backend)
        self.compressor = ElasticCompressor(hidden_size, image_grid, compression_ratio, resampler_queries)
        self.gate = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, hidden_size), nn.GELU(),
                                  nn.Linear(hidden_size, len(PRIMITIVES)))
        self.gate_temperature = gate_temperature
        self.last_choice: torch.Tensor | None = None  # [R] primitive index per row of the last `begin`

    @classmethod
    def for_target(cls, target, **overrides):
        tokens = getattr(target, "fixed_image_tokens", None)  # LLaVA-1.5, Gemma 3: one run size for every image
        check(tokens is not None and math.isqrt(tokens) ** 2 == tokens,
              f"SpecVLM's compressor pools one fixed square image grid (LLaVA's image_seq_length, Gemma 3's "
              f"mm_tokens_per_image); "
              f"{type(target.model).__name__} images vary in size: use the eagle, vispec or msd drafter.")
        return super().for_target(target, **{"image_grid": math.isqrt(tokens), **overrides})

    def choose(self, question_features: torch.Tensor, generator: torch.Generator | None = None,
               train: bool = False) -> torch.Tensor:
        """question_features [N, H] -> one-hot choice weights [N, 5]: straight-through Gumbel-softmax in training
        (hard forward, soft gradient), argmax otherwise."""
        logits = self.gate(question_features.to(self.fc.weight.dtype)).float()  # [N, 5]
        if not train:
            return F.one_hot(logits.argmax(-1), len(PRIMITIVES)).to(logits.dtype)
        u = torch.rand(logits.shape, generator=generator).clamp(1e-9, 1 - 1e-9).to(logits.device)
        soft = torch.softmax((logits - torch.log(-torch.log(u))) / self.gate_temperature, dim=-1)
        hard = F.one_hot(soft.argmax(-1), len(PRIMITIVES)).to(soft.dtype)
        return hard - soft.detach() + soft

    def compress(self, image: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """image [N, T, H], choice weights [N, 5] -> (tokens [N, M, H] padded to the largest primitive, counts [N]):
        the weighted sum of the padded primitive outputs (= the chosen one's, with the gate's gradient)."""
        outs = self.compressor(image.to(self.fc.weight.dtype))
        m = max(self.compressor.sizes)
        padded = torch.stack([F.pad(o, (0, 0, 0, m - o.shape[1])) for o in outs], dim=1)  # [N, 5, M, H]
        tokens = (weights.to(padded.dtype)[:, :, None, None] * padded).sum(1)  # [N, M, H]
        return tokens, self.compressor.sizes_tensor().to(image.device)[weights.argmax(-1)]


def question_features(input_ids: torch.Tensor, features: torch.Tensor, lengths: torch.Tensor,
                      image_token_id: int) -> torch.Tensor:
    """The mean target feature over each row's prompt text after its image run [B, H] (the gate's input)."""
    is_image = input_ids == image_token_id
    last_image = torch.where(is_image, torch.arange(input_ids.shape[1], device=input_ids.device), -1).max(-1).values
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    mask = (cols > last_image.unsqueeze(-1)) & (cols < lengths.unsqueeze(-1))  # [B, P]
    weight = mask.float() / mask.float().sum(-1, keepdim=True).clamp_min(1.0)
    return (features.float() * weight.unsqueeze(-1)).sum(1)


def specvlm_layout(drafter: VLMSpecVLMDrafter, input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                   lengths: torch.Tensor, prompt_lengths: torch.Tensor, image_token_id: int, *, train: bool = False,
                   generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The drafter's inputs for sequences [B, L] with one image run each (or none: a text-only row): pairs
    (e_i, f_{i-1}) at positions 1..L-1 with the run [s, e] replaced by the chosen primitive's K_b tokens at positions
    e-K_b+1..e (paired with f_{pos-1}). Rows are right-padded to the longest layout. Returns embeds, features,
    positions, source (the original position of each element: its target is f_source), valid [B, L'], count [B]
    (real elements) and choice [B] (primitive index; text_only for a row without an image). The gate reads the
    question features of the first prompt_lengths tokens."""
    b, length = input_ids.shape
    h = embeds.shape[-1]
    is_image = input_ids == image_token_id
    has = is_image.any(-1)  # [B] rows with an image (text-only rows mix in: no run, nothing to compress)
    run_lengths = is_image.sum(-1)[has]
    t_img = int(run_lengths[0]) if len(run_lengths) else 0
    check(bool((run_lengths == t_img).all()),
          "SpecVLM expects image runs of one length (its compressor's fixed image grid) in every row with an image.")
    start = is_image.float().argmax(-1)  # [B]
    end = start + t_img - 1
    q = question_features(input_ids, features, prompt_lengths, image_token_id)  # [B, H]
    text_only = F.one_hot(torch.tensor(PRIMITIVES.index("text_only")), len(PRIMITIVES)).to(q)
    weights = torch.where(has.unsqueeze(-1), drafter.choose(q, generator, train), text_only)  # [B, 5]
    m = max(drafter.compressor.sizes)
    tokens = embeds.new_zeros(b, m, h)  # [B, M, H]
    counts = torch.zeros(b, dtype=torch.long, device=input_ids.device)
    if t_img:  # rows with an image get their run's compressed tokens (autograd flows through the assignment)
        tokens[has], counts[has] = drafter.compress(embeds[is_image].view(-1, t_img, h), weights[has])
    rows = []
    for r in range(b):
        s, e, k = int(start[r]), int(end[r]), int(counts[r])
        positions = list(range(1, s)) + list(range(e - k + 1, e + 1)) + list(range(e + 1, length)) if has[r] \
            else list(range(1, length))
        rows.append(positions)
    width = max(len(p) for p in rows)
    positions = torch.zeros(b, width, dtype=torch.long, device=input_ids.device)
    is_token = torch.zeros(b, width, dtype=torch.bool, device=input_ids.device)
    token_index = torch.zeros(b, width, dtype=torch.long, device=input_ids.device)
    count = torch.zeros(b, dtype=torch.long, device=input_ids.device)
    for r, p in enumerate(rows):
        positions[r, : len(p)] = torch.tensor(p)
        s, k = int(start[r]), int(counts[r])
        cols = torch.arange(s - 1, s - 1 + k)
        is_token[r, cols] = True
        token_index[r, cols] = torch.arange(k)
        count[r] = sum(1 for pos in p if pos < int(lengths[r]))
    valid = torch.arange(width, device=input_ids.device) < count.unsqueeze(-1)
    pair_embeds = embeds.gather(1, positions.clamp_min(0).unsqueeze(-1).expand(-1, -1, h))
    compressed = tokens.gather(1, token_index.unsqueeze(-1).expand(-1, -1, h)).to(pair_embeds.dtype)
    pair_embeds = torch.where(is_token.unsqueeze(-1), compressed, pair_embeds)
    pair_features = features.gather(1, (positions - 1).clamp_min(0).unsqueeze(-1).expand(-1, -1, h))
    return {"embeds": pair_embeds, "features": pair_features, "positions": positions.clamp_min(1),
            "source": positions, "valid": valid, "count": count, "choice": weights.argmax(-1),
            "image_tokens": torch.full((b,), t_img), "kept": counts}


class VLMSpecVLMTreeDrafter(VLMEagleTreeDrafter):
    """EAGLE-2 trees from a SpecVLM drafter: `begin` gates and compresses each row's image, runs the layout into
    the drafter's cache and sets the per-row position offsets."""

    def begin(self, inputs: VLMInputs, state: DecodeState) -> None:
        target, drafter = self.target, self.drafter
        b, p = inputs.input_ids.shape
        features = self.target_features(b, p, "prefill")  # [B, P, H]
        embeds = target.prompt_embeds
        check(embeds is not None and embeds.shape[:2] == (b, p), "run the target's prefill (prefill_vlm) first.")
        ids = inputs.input_ids.to(features.device)
        lengths = inputs.lengths.to(features.device)
        with torch.no_grad():
            layout = specvlm_layout(drafter, ids, embeds, features, lengths, lengths, target.image_token_id)
        drafter.last_choice = layout["choice"]
        width = layout["positions"].shape[1]
        cache = drafter.new_cache(b, width + state.max_new_tokens + self.width + self.max_pool)
        self.runner.cache = cache
        slots = cache.slots(width)
        drafter.forward_cached(None, layout["positions"], cache, slots, cache.attention_mask(slots),
                               features=layout["features"], embeds=layout["embeds"])
        self.runner.forwards += 1
        self.runner.commit_chain(layout["count"])
        self.position_offset = lengths - layout["count"]  # next element: position P_b at slot count_b
        last = (lengths - 1).view(b, 1, 1).expand(-1, -1, features.shape[-1])
        self.pending = PendingPairs(state.last_token, features.gather(1, last)[:, 0], self.width)


VLMSpecVLMDrafter.loop_drafter = VLMSpecVLMTreeDrafter  # what the loop runs for this drafter model
