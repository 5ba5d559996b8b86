"""ViSpec: a vision-aware EAGLE drafter. A vision adaptor compresses each image run into num_q - 1 tokens for the
drafter's sequence and one global image vector that is fused into the text features.

The model (`VLMViSpecDrafter`, an EagleVLM drafter plus two modules, from the official code, KangJialiang/ViSpec
`vispec/model/cnets_ours.py` at d0240c8 (arXiv 2509.15235); the module names are the official checkpoint's):

- `imadpt` (`ImageAdaptor`): learned queries q [num_q, heads, head_dim] ~ N(0, head_dim^-1/2) attend, in ONE
  cross-attention without RoPE and without a query projection, to the image run's input embeddings (the target's
  projected vision features) through bias-free k / v projections; a bias-free o projection; the target's head
  count. Outputs 0..num_q - 2 are the compressed image tokens, the last one the global image feature g.
- the drafter's sequence holds the compressed tokens in place of the image run, at the run's LAST num_q - 1
  positions (later text keeps its true positions); they enter the decoder layer directly (no fc, no target
  feature).
- every text position reads x_t = fc([e_t ; img_fc([f_{t-1} ; g_t])]), g_t = g after the image and 0 before it
  (and everywhere in a text-only sequence); img_fc: 2H -> H initialised [I | 0], bias 0.

Prompts hold at most one image run per row (LLaVA-1.5 style; Qwen2-VL's runs differ in length with the image
size, and text-only rows mix with image rows); `VLMViSpecTreeDrafter.begin` lays out the ragged rows and sets the
per-row position offsets.

Training (`mmspec train vlm-drafter --kind vispec`, as the official main.py / main_mtp.py): stage 1 on text alone
(the sequences without their image, run through the target with no image), SmoothL1(features) + 0.1 x (soft CE +
0.1 x top-10 ranking loss); stage 2 multimodal, 10 x L1(p_draft - p_target) + 0.1 x ranking loss and no feature
loss, over two passes: the plain one and the anti-shortcut one, whose text features are the drafter's own
first-pass outputs shifted right at every element but the first, with gradients through both passes.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.errors import check
from mmspec.loop import DecodeState
from mmspec.tree import levels_of_eagle_depth
from vlm.eagle import VLMEagleDrafter, VLMEagleTreeDrafter
from vlm.target import VLMInputs

# ViSpec's tree: EAGLE's depth 3 (4 draft levels), top_k 8, total 30
VISPEC_TREE = (levels_of_eagle_depth(3), 8, 30)


class ImageAdaptor(nn.Module):
    """ViSpec's vision adaptor (official `ImgAdaptor`; see the module docstring)."""

    def __init__(self, hidden_size: int, num_heads: int, num_queries: int = 2, qkv_bias: bool = False) -> None:
        super().__init__()
        check(hidden_size % num_heads == 0, f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}.")
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q = nn.Parameter(torch.randn(num_queries, num_heads, self.head_dim) * self.head_dim ** -0.5)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, image_embeds: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """image_embeds [N, T, H] (key_mask [N, T]: True = attend; None = all) -> [N, num_q, H]."""
        n, t, h = image_embeds.shape
        q = self.q.to(image_embeds.dtype).transpose(0, 1).unsqueeze(0).expand(n, -1, -1, -1)  # [N, heads, Q, d]
        k = self.k_proj(image_embeds).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)  # [N, heads, T, d]
        v = self.v_proj(image_embeds).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # [N, 1, 1, T]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [N, heads, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(n, -1, h))


class VisionAdaptor:
    """ViSpec's vision awareness, mixed into a feature drafter model (before its base class): `imadpt` compresses an
    image run into num_q - 1 tokens and a global feature g (`compress`), `img_fc` ([I | 0], bias 0 at the start:
    the plain drafter) fuses g into a text element's feature (`with_global`), and `forward_cached` fuses it into
    every decoded element once the loop drafter's `begin` has set `global_feature` [R, H]."""

    global_feature: torch.Tensor | None = None

    def add_vision_adaptor(self, hidden_size: int, num_heads: int, num_queries: int, qkv_bias: bool,
                           fc_bias: bool) -> None:
        self.imadpt = ImageAdaptor(hidden_size, num_heads, num_queries, qkv_bias)
        self.img_fc = nn.Linear(2 * hidden_size, hidden_size, bias=fc_bias)
        with torch.no_grad():
            self.img_fc.weight.zero_()
            self.img_fc.weight[:, :hidden_size] = torch.eye(hidden_size)
            if self.img_fc.bias is not None:
                self.img_fc.bias.zero_()
        self.global_feature = None  # [R, H] g of the rows being decoded (set by begin)

    def feature_to_fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The [.., H] feature img_fc reads for `features` (the features themselves; EAGLE-3: fc of its inputs)."""
        return features

    def compress(self, image_embeds: torch.Tensor,
                 key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """image_embeds [N, T, H] (key_mask [N, T]: True = part of the run) -> (compressed tokens
        [N, num_q - 1, H], global feature g [N, H])."""
        out = self.imadpt(image_embeds.to(self.fc.weight.dtype), key_mask)
        return out[:, :-1], out[:, -1]

    def with_global(self, features: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """img_fc([feature_to_fuse(features) ; g]): features [R, S, F], g [R, H] or [R, S, H] -> [R, S, H]."""
        features = self.feature_to_fuse(features)
        g = g.to(features.dtype)
        g = g.unsqueeze(1).expand_as(features) if g.dim() == 2 else g
        return self.img_fc(torch.cat([features, g], dim=-1))

    @torch.no_grad()
    def forward_cached(self, tokens, positions, cache, slots, mask, *, features, **inputs):
        """As the drafter's own; after `begin`, decoded (text) elements' features are fused with g first."""
        if self.global_feature is not None:
            features = self.with_global(features, self.global_feature)
        return super().forward_cached(tokens, positions, cache, slots, mask, features=features, **inputs)


class VLMViSpecDrafter(VisionAdaptor, VLMEagleDrafter):
    """EagleVLM drafter + vision adaptor `imadpt` + `img_fc` (see the module docstring)."""

    official_tree = VISPEC_TREE
    one_image_run = True  # its layout compresses one image run a row

    def image_tokens_attended(self, num_image_tokens: int) -> float:
        """num_q - 1 compressed image tokens per row."""
        return self.config.num_queries - 1

    @register_to_config
    def __init__(self, hidden_size: int = 4096, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 intermediate_size: int = 11008, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 4096, vocab_size: int = 32064, input_norm: bool = False,
                 fc_bias: bool = True, attention_backend: str | None = None, num_queries: int = 2,
                 qkv_bias: bool = False) -> None:
        super().__init__(hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps,
                         rope_theta, max_position_embeddings, vocab_size, input_norm, fc_bias, attention_backend)
        check(num_queries >= 2, f"ViSpec needs at least 2 queries (compressed tokens + global feature), got "
                                f"{num_queries}.")
        self.add_vision_adaptor(hidden_size, num_attention_heads, num_queries, qkv_bias, fc_bias)


def vispec_layout(drafter: VLMViSpecDrafter, input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                  image_token_id: int, shortcut_features: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The drafter's inputs for sequences [B, L] holding at most one image run per row, of any length (rows with
    images of different sizes and text-only rows mix). Elements at positions i = 1..L-1: text pairs
    (e_i, img_fc([f_{i-1} ; g_i])), g_i = g after the run and 0 before it; the run [s, e] replaced by its num_q - 1
    compressed tokens at positions e - num_q + 2..e, marked `direct`. `shortcut_features` [B, L, H] (the
    anti-shortcut pass; own[j] = the drafter's prediction of f_j) replaces f_{i-1} at every text element but the
    first. Rows keep different numbers of elements: each row's come first, `valid` [B, L'] marks them. Returns
    embeds, features, direct, positions [B, L'], `source` [B, L'] (= positions: element i's target is f_i),
    valid, g [B, H], image_tokens [B] and dropped [B] (image positions without a compressed token). features may be
    of any width the drafter's `with_global` reads (an EAGLE-3 drafter's: the target's fused layer inputs [B, L, 3H]).
    """
    b, length = input_ids.shape
    h = embeds.shape[-1]
    n_c = drafter.config.num_queries - 1
    is_image = input_ids == image_token_id  # [B, L]
    count = is_image.sum(-1)  # [B]
    has = count > 0
    start = is_image.float().argmax(-1)  # [B] first image position s (0 without an image)
    end = torch.where(has, start + count - 1, -1).unsqueeze(-1)  # [B, 1] e (-1 without an image)
    pos = torch.arange(length, device=input_ids.device)
    one_run = (pos >= start.unsqueeze(-1)) & (pos <= end)
    check(bool((one_run == is_image).all()), "ViSpec takes at most one image run per row.")
    check(bool((count[has] >= n_c).all()), f"ViSpec places {n_c} compressed tokens inside each image run; a run "
                                           f"has only {int(count[has].min()) if bool(has.any()) else 0}.")
    dropped = torch.where(has, count - n_c, 0)  # [B]
    keep = torch.arange(1, length, device=input_ids.device).unsqueeze(0).expand(b, -1)  # [B, L-1] positions i
    kept = ~((keep >= start.unsqueeze(-1)) & (keep <= end - n_c))  # [B, L-1]
    width = int(length - 1 - dropped.min())
    order = torch.sort((~kept).to(torch.uint8), dim=-1, stable=True).indices[:, :width]  # kept positions first
    valid = torch.arange(width, device=input_ids.device) < (length - 1 - dropped).unsqueeze(-1)  # [B, L']
    source = torch.where(valid, keep.gather(1, order), length - 1)  # [B, L'] original positions
    if bool(has.any()):
        t_max = int(count.max())
        run = (start.unsqueeze(-1) + torch.arange(t_max, device=input_ids.device)).clamp(max=length - 1)  # [B, T]
        image_embeds = embeds.gather(1, run.unsqueeze(-1).expand(-1, -1, h))  # [B, T, H]
        in_run = torch.arange(t_max, device=input_ids.device) < count.unsqueeze(-1)  # [B, T]
        same = bool((count == t_max).all())  # one size in every row: no key mask (the trained drafters' path)
        tokens, g = drafter.compress(image_embeds, None if same else in_run | ~has.unsqueeze(-1))
        g = torch.where(has.unsqueeze(-1), g, 0)  # [B, H]
    else:
        tokens, g = None, embeds.new_zeros(b, h)
    index = source.unsqueeze(-1).expand(-1, -1, h)
    pair_embeds = embeds.gather(1, index)  # e_i
    pair_features = features.gather(1, source.unsqueeze(-1).expand(-1, -1, features.shape[-1]) - 1)  # f_{i-1}
    if shortcut_features is not None:
        own = shortcut_features.gather(1, index - 1)
        later = (torch.arange(source.shape[1], device=source.device) > 0).view(1, -1, 1)
        pair_features = torch.where(later, own.to(pair_features.dtype), pair_features)
    direct = valid & (source <= end) & (source > end - n_c)  # [B, L'] compressed tokens
    if tokens is not None:
        slot = (source - (end - n_c + 1)).clamp(0, n_c - 1)  # [B, L'] which compressed token
        compressed = tokens.gather(1, slot.unsqueeze(-1).expand(-1, -1, h)).to(pair_embeds.dtype)
        pair_embeds = torch.where(direct.unsqueeze(-1), compressed, pair_embeds)
    after = (source > end).unsqueeze(-1)  # [B, L', 1] text after the image
    g_i = torch.where(after, g.unsqueeze(1).to(pair_embeds.dtype), torch.zeros_like(pair_embeds))  # [B, L', H]
    pair_features = drafter.with_global(pair_features, g_i)
    return {"embeds": pair_embeds, "features": pair_features, "direct": direct, "positions": source,
            "source": source, "valid": valid, "g": g, "image_tokens": count, "dropped": dropped}


class VLMViSpecTreeDrafter(VLMEagleTreeDrafter):
    """EAGLE-2 trees from a ViSpec drafter: `begin` compresses each row's image, runs the short prompt layout
    into the drafter's cache and sets g and the per-row position offsets."""

    def begin(self, inputs: VLMInputs, state: DecodeState) -> None:
        target, drafter = self.target, self.drafter
        drafter.global_feature = None
        b, p = inputs.input_ids.shape
        features = self.target_features(b, p, "prefill")  # [B, P, H]
        embeds = target.prompt_embeds  # [B, P, H]
        check(embeds is not None and embeds.shape[:2] == (b, p), "run the target's prefill (prefill_vlm) first.")
        ids = inputs.input_ids.to(features.device)
        lengths = inputs.lengths.to(features.device)
        layout = vispec_layout(drafter, ids, embeds, features, target.image_token_id)
        dropped = layout["dropped"]  # [B] image positions without a compressed token
        # each row keeps its P_b - 1 pairs minus the dropped ones
        self.run_prompt_layout(state, layout["positions"], lengths - 1 - dropped, features=layout["features"],
                               embeds=layout["embeds"], direct=layout["direct"])
        self.position_offset = 1 + dropped  # [B]
        drafter.global_feature = layout["g"]  # every decoded element is text after the image (g = 0 without one)
        self.pend_first_pair(state, features, lengths)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.drafter.global_feature = self.drafter.global_feature.index_select(0, rows)  # [R', H] (no CFG: R = B)


VLMViSpecDrafter.loop_drafter = VLMViSpecTreeDrafter  # what the loop runs for this drafter model
