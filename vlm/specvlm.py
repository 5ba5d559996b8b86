"""SpecVLM: EagleVLM with an elastic visual compressor chosen per input by a question-aware gate, trained by online
logit distillation (from the SpecVLM paper, arXiv 2509.11815).

The compressor offers five primitives over a row's image run (T input embeddings, the target's projected vision
features), each giving a different number of tokens:

| primitive   | tokens         | what it does                                                                      |
|-------------|----------------|-----------------------------------------------------------------------------------|
| `prune`     | ceil(T / r)    | keeps the ceil(T / r) tokens of largest L2 norm (token drop), in their order      |
| `pool`      | per grid cell  | 2D average pooling over each image grid (kernel and stride sqrt(r))               |
| `conv`      | per grid cell  | a learned 2D convolution over each image grid (kernel and stride sqrt(r))         |
| `resample`  | 2              | a 1-layer Q-former: 2 learned queries cross-attending to the run (best at 2)      |
| `text_only` | 0              | drops every vision token                                                          |

The grids are the run's 2D feature maps, which the target knows (`CachedVLM.image_grids`): one g x g square for
LLaVA-1.5 and Gemma 3 (T / r tokens after pooling, as the paper's), the merged patch grid of each image for
Qwen2-VL (sizes vary), the base view and the aspect-unpadded tiles for LLaVA-NeXT / OneVision (their newline tokens
are in neither grid; prune and resample read them). A grid side that sqrt(r) does not divide ends in a partial
window: pooling averages the tokens it covers, the convolution sees zeros past the border.

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
from mmspec.loop import DecodeState
from vlm.eagle import SPECVLM_TREE, VLMEagleDrafter, VLMEagleTreeDrafter
from vlm.target import Grid, VLMInputs, square_grid

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


def grid_tokens(image: torch.Tensor, grid: Grid) -> torch.Tensor:
    """image [N, T, H] -> the grid's tokens as feature maps [N, H, height, width]."""
    offset, height, width, stride = grid
    rows = torch.arange(height, device=image.device).unsqueeze(-1) * stride + offset
    index = (rows + torch.arange(width, device=image.device)).flatten()  # [height * width]
    return image[:, index].transpose(1, 2).reshape(image.shape[0], image.shape[2], height, width)


class ElasticCompressor(nn.Module):
    """The five compression primitives (see the module docstring) over image runs [N, T, H] that share one layout:
    `grids`, the rectangles of the run that are 2D feature maps (a square for LLaVA-1.5, the merged patch grid for
    Qwen2-VL, the base view and the unpadded tiles for LLaVA-NeXT / OneVision, whose newline tokens are in no
    rectangle). `pool` and `conv` work on each rectangle (windows of sqrt(ratio) a side; a partial window at a
    border averages the tokens it covers, the convolution sees zeros there); `prune` and `resample` read the whole
    run. `grid` is the square assumed for a run of grid^2 tokens when no grids are given."""

    def __init__(self, hidden_size: int, grid: int, ratio: int = 4, num_queries: int = 2, heads: int = 4) -> None:
        super().__init__()
        side = math.isqrt(ratio)
        check(side * side == ratio, f"the compression ratio {ratio} must be a square (4, 9, 16, ..).")
        self.grid, self.ratio, self.side, self.num_queries = grid, ratio, side, num_queries
        self.conv = nn.Conv2d(hidden_size, hidden_size, kernel_size=side, stride=side)
        self.resampler = QueryResampler(hidden_size, num_queries, heads)

    def default_grids(self, num_tokens: int) -> list[Grid]:
        check(num_tokens == self.grid * self.grid,
              f"an image run of {num_tokens} tokens is not the {self.grid}x{self.grid} grid this compressor assumes "
              "without the target's image grids.")
        return square_grid(self.grid)

    def sizes(self, num_tokens: int, grids: list[Grid]) -> list[int]:
        """Tokens per primitive (PRIMITIVES order) for a run of num_tokens with these grids."""
        pooled = sum(-(-h // self.side) * -(-w // self.side) for _, h, w, _ in grids)
        return [-(-num_tokens // self.ratio), pooled, pooled, self.num_queries, 0]

    def forward(self, image: torch.Tensor, grids: list[Grid] | None = None) -> list[torch.Tensor]:
        """image [N, T, H] -> one [N, K_k, H] tensor per primitive (PRIMITIVES order)."""
        n, t, h = image.shape
        grids = self.default_grids(t) if grids is None else grids
        check(all(0 <= o and o + (hh - 1) * s + w <= t for o, hh, w, s in grids),
              f"the image grids {grids} do not lie inside the image run of {t} tokens.")
        keep = image.norm(dim=-1).topk(self.sizes(t, grids)[0], dim=-1).indices.sort(dim=-1).values  # [N, K]
        pruned = image.gather(1, keep.unsqueeze(-1).expand(-1, -1, h))
        maps = [grid_tokens(image, g) for g in grids]  # [N, H, height, width] each
        pooled = [F.avg_pool2d(m, self.side, ceil_mode=True).flatten(2) for m in maps]  # [N, H, k] each
        pad = [(0, -m.shape[3] % self.side, 0, -m.shape[2] % self.side) for m in maps]
        conv = [self.conv(F.pad(m, p)).flatten(2) for m, p in zip(maps, pad)]
        pooled, conv = (torch.cat(x, dim=2).transpose(1, 2) if x else image[:, :0] for x in (pooled, conv))
        return [pruned, pooled, conv, self.resampler(image), image[:, :0]]


class VLMSpecVLMDrafter(VLMEagleDrafter):
    """EagleVLM + elastic compressor + question-aware gate (see the module docstring); layer 0 keeps its input
    norm by default (SpecVLM's EagleVLM adds it)."""

    official_tree = SPECVLM_TREE
    one_image_run = True  # its compressor pools one image run a row

    def image_tokens_attended(self, num_image_tokens: int) -> float:
        """The compressed size the gate chose (the last batch's rows averaged)."""
        return float(self.last_kept.float().mean())

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
        self.last_kept: torch.Tensor | None = None  # [R] compressed image tokens per row of the last `begin`

    @classmethod
    def for_target(cls, target, **overrides):
        square = {}  # LLaVA-1.5, Gemma 3: one square grid for every image (refused here if it is not one)
        if getattr(target, "fixed_image_tokens", None) is not None:
            square = {"image_grid": target.fixed_square_grid()[0][1]}
        return super().for_target(target, **{**square, **overrides})

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

    def compress(self, runs: list[torch.Tensor], grids: list[list[Grid] | None],
                 weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """N image runs [T_n, H] with their grids (None: the default square), choice weights [N, 5] -> (tokens
        [N, M, H] padded to the largest primitive output, counts [N]): the weighted sum of the padded primitive
        outputs (= the chosen one's, with the gate's gradient). Runs of one length and grids compress together."""
        dtype = self.fc.weight.dtype
        grids = [g or self.compressor.default_grids(len(r)) for r, g in zip(runs, grids)]
        sizes = [self.compressor.sizes(len(r), g) for r, g in zip(runs, grids)]
        m = max(max(k) for k in sizes)
        groups: dict[tuple, list[int]] = {}
        for n, (run, grid) in enumerate(zip(runs, grids)):
            groups.setdefault((len(run), tuple(grid)), []).append(n)
        tokens = weights.new_zeros(len(runs), m, runs[0].shape[-1], dtype=dtype)  # [N, M, H]
        for (_, grid), rows in groups.items():
            outs = self.compressor(torch.stack([runs[n] for n in rows]).to(dtype), list(grid))
            padded = torch.stack([F.pad(o, (0, 0, 0, m - o.shape[1])) for o in outs], dim=1)  # [n, 5, M, H]
            tokens = tokens.index_put((torch.tensor(rows, device=tokens.device),),
                                      (weights[rows].to(dtype)[:, :, None, None] * padded).sum(1))
        chosen = weights.argmax(-1).tolist()
        return tokens, torch.tensor([k[c] for k, c in zip(sizes, chosen)], device=weights.device)


def question_features(input_ids: torch.Tensor, features: torch.Tensor, lengths: torch.Tensor,
                      image_token_id: int) -> torch.Tensor:
    """The mean target feature over each row's prompt text after its image run [B, H] (the gate's input)."""
    is_image = input_ids == image_token_id
    last_image = torch.where(is_image, torch.arange(input_ids.shape[1], device=input_ids.device), -1).max(-1).values
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    mask = (cols > last_image.unsqueeze(-1)) & (cols < lengths.unsqueeze(-1))  # [B, P]
    weight = mask.float() / mask.float().sum(-1, keepdim=True).clamp_min(1.0)
    return (features.float() * weight.unsqueeze(-1)).sum(1)


def image_run_bounds(is_image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """is_image [B, L] -> (start [B], run length [B]) of each row's one image run (0, 0 for a text-only row);
    InputError for a row with two images (SpecVLM compresses one image per prompt)."""
    cols = torch.arange(is_image.shape[1], device=is_image.device)
    start = is_image.float().argmax(-1)  # [B]
    length = is_image.sum(-1)  # [B]
    last = torch.where(is_image, cols, -1).max(-1).values
    one_run = (length == 0) | (last - start + 1 == length)
    check(bool(one_run.all()), "SpecVLM compresses one image per prompt; a prompt holds several: use the eagle, "
                               "vispec or msd drafter for prompts with several images.")
    return start, length


def specvlm_layout(drafter: VLMSpecVLMDrafter, input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                   lengths: torch.Tensor, prompt_lengths: torch.Tensor, image_token_id: int, *, train: bool = False,
                   generator: torch.Generator | None = None,
                   image_grids: list[list[Grid]] | None = None) -> dict[str, torch.Tensor]:
    """The drafter's inputs for sequences [B, L] with one image run each (or none: a text-only row): pairs
    (e_i, f_{i-1}) at positions 1..L-1 with the run [s, e] replaced by the chosen primitive's K_b tokens at positions
    e-K_b+1..e (paired with f_{pos-1}). Rows are right-padded to the longest layout. Returns embeds, features,
    positions, source (the original position of each element: its target is f_source), valid [B, L'], count [B]
    (real elements) and choice [B] (primitive index; text_only for a row without an image). The gate reads the
    question features of the first prompt_lengths tokens. `image_grids`: the 2D grids of each image's run, in row
    order (the target's `image_grids`); None: every run is the compressor's default square."""
    b, length = input_ids.shape
    h, device = embeds.shape[-1], input_ids.device
    is_image = input_ids == image_token_id
    start, run_length = image_run_bounds(is_image)  # [B], [B]
    has = run_length > 0  # [B] rows with an image (text-only rows mix in: no run, nothing to compress)
    end = start + run_length - 1
    # the layout is index bookkeeping: each row's bounds are read once and the indices built on the host
    starts, ends, row_lengths, run_lengths = torch.stack(
        [start, end, lengths.to(start.device).long(), run_length]).tolist()  # [4, B] -> lists
    image_rows = [r for r, n in enumerate(run_lengths) if n > 0]
    image_index = torch.tensor(image_rows, dtype=torch.long, device=device)  # [N]
    check(image_grids is None or len(image_grids) == len(image_rows),
          f"{len(image_rows)} prompts hold an image but {len(image_grids or [])} image grids were given.")
    q = question_features(input_ids, features, prompt_lengths, image_token_id)  # [B, H]
    text_only = F.one_hot(torch.tensor(PRIMITIVES.index("text_only")), len(PRIMITIVES)).to(q)
    weights = torch.where(has.unsqueeze(-1), drafter.choose(q, generator, train), text_only)  # [B, 5]
    runs = [embeds[r, starts[r]: ends[r] + 1] for r in image_rows]  # each [T_r, H]
    counts = torch.zeros(b, dtype=torch.long, device=device)
    if image_rows:  # rows with an image get their run's compressed tokens (autograd flows through the assignment)
        tokens, kept = drafter.compress(runs, image_grids or [None] * len(runs), weights[image_index])
        tokens = embeds.new_zeros(b, tokens.shape[1], h, dtype=tokens.dtype).index_put((image_index,), tokens)
        counts[image_index] = kept.to(counts.device)
    else:
        tokens = embeds.new_zeros(b, 1, h)  # [B, M, H]
    kept_counts = counts.tolist()
    rows = [list(range(1, s)) + list(range(e - k + 1, e + 1)) + list(range(e + 1, length)) if run
            else list(range(1, length)) for s, e, k, run in zip(starts, ends, kept_counts, run_lengths)]
    width = max(len(p) for p in rows)
    positions = torch.tensor([p + [0] * (width - len(p)) for p in rows], dtype=torch.long, device=device)  # [B, L']
    column = torch.arange(width, device=device) - (start - 1).unsqueeze(-1)  # [B, L'] offset from the run's column
    is_token = (column >= 0) & (column < counts.unsqueeze(-1))  # [B, L'] the row's compressed tokens
    token_index = torch.where(is_token, column, 0)  # [B, L'] which compressed token (0 elsewhere)
    count = torch.tensor([sum(pos < n for pos in p) for p, n in zip(rows, row_lengths)], dtype=torch.long,
                         device=device)  # [B] real elements
    valid = torch.arange(width, device=device) < count.unsqueeze(-1)
    pair_embeds = embeds.gather(1, positions.clamp_min(0).unsqueeze(-1).expand(-1, -1, h))
    compressed = tokens.gather(1, token_index.unsqueeze(-1).expand(-1, -1, h)).to(pair_embeds.dtype)
    pair_embeds = torch.where(is_token.unsqueeze(-1), compressed, pair_embeds)
    pair_features = features.gather(1, (positions - 1).clamp_min(0).unsqueeze(-1).expand(-1, -1, h))
    return {"embeds": pair_embeds, "features": pair_features, "positions": positions.clamp_min(1),
            "source": positions, "valid": valid, "count": count, "choice": weights.argmax(-1),
            "image_tokens": run_length, "kept": counts}


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
            layout = specvlm_layout(drafter, ids, embeds, features, lengths, lengths, target.image_token_id,
                                    image_grids=target.image_grids(inputs, embeds))
        drafter.last_choice, drafter.last_kept = layout["choice"], layout["kept"]
        self.run_prompt_layout(state, layout["positions"], layout["count"], features=layout["features"],
                               embeds=layout["embeds"])
        self.position_offset = lengths - layout["count"]  # next element: position P_b at slot count_b
        self.pend_first_pair(state, features, lengths)


VLMSpecVLMDrafter.loop_drafter = VLMSpecVLMTreeDrafter  # what the loop runs for this drafter model
