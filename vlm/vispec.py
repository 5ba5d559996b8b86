"""ViSpec: a vision-aware EAGLE drafter. A vision adaptor compresses each image run into one token for the
drafter's sequence and one global image vector that is fused into every later text position.

The model (`VLMViSpecDrafter`, an EagleVLM drafter plus two modules, from the paper and reference/vlm.md):

- vision adaptor: `num_queries` learned queries (init N(0, H^-1/2)) attend, in ONE cross-attention without
  RoPE, to the image run's input embeddings (the target's projected vision features). With the default two
  queries, output 0 is the compressed image token c and output 1 the global image feature g.
- the drafter's sequence holds c in place of the whole image run, at the run's LAST position (so later text
  keeps its true positions): the drafter's cache is short (P - T_img + 1 prompt entries) but its positions
  are the target's.
- every text position after the image reads x_t = fc([e_t ; img_fc([f_{t-1} ; g])]), img_fc: 2H -> H
  initialised to [I | 0] with bias 0 (so training starts from EagleVLM); positions before the image and the
  compressed token itself read the plain EAGLE pair.

Which feature pairs with c is not fixed by the paper's text: here c sits at the run's last position e with the
target feature f_{e-1} (the one that predicts that position), like any other element. Prompts hold exactly one
image run per row (LLaVA-1.5 style); `VLMViSpecTreeDrafter.begin` lays out the ragged rows and sets the
per-row position offsets (cache slot j -> position j + T_img for every decoded element).

Training (`mmspec train vlm-drafter --kind vispec`): stage 1 text-only (the image run removed from the sequence,
no global feature), stage 2 multimodal on the target's own long answers, with the paper's anti-shortcut second
pass: the drafter's own first-pass features, shifted right, replace the target's on the text after the image
and are supervised against the same targets (the drafter never has the target's features after its first
draft step). The second pass's inputs are detached (a choice the paper does not state).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import register_to_config
from torch import nn

from mmspec.errors import check
from mmspec.feature_drafter import PendingPairs
from mmspec.loop import DecodeState
from mmspec.sampling import SamplingParams
from vlm.eagle import DEFAULT_DEPTH, DEFAULT_TOP_K, DEFAULT_TOTAL_TOKENS, VLMEagleDrafter, VLMEagleTreeDrafter
from vlm.target import LlavaCachedLM, VLMInputs


class VisionAdaptor(nn.Module):
    """`num_queries` learned queries cross-attending (one multi-head attention, no RoPE) to image embeddings."""

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
        out = torch.nn.functional.scaled_dot_product_attention(q.expand(n, -1, -1, -1), k, v)  # [N, heads, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(n, -1, h))


class VLMViSpecDrafter(VLMEagleDrafter):
    """EagleVLM drafter + vision adaptor + img_fc (see the module docstring)."""

    def image_tokens_attended(self, num_image_tokens: int) -> float:
        """One compressed image token per row."""
        return 1

    @register_to_config
    def __init__(self, hidden_size: int = 4096, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 intermediate_size: int = 11008, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 4096, vocab_size: int = 32064, input_norm: bool = True,
                 fc_bias: bool = True, attention_backend: str | None = None, num_queries: int = 2,
                 adaptor_heads: int = 4) -> None:
        super().__init__(hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps,
                         rope_theta, max_position_embeddings, vocab_size, input_norm, fc_bias, attention_backend)
        check(num_queries >= 2, f"ViSpec needs at least 2 queries (compressed token + global feature), got "
                                f"{num_queries}.")
        self.adaptor = VisionAdaptor(hidden_size, num_queries, adaptor_heads)
        self.img_fc = nn.Linear(2 * hidden_size, hidden_size)
        with torch.no_grad():  # [I | 0], bias 0: starts as the plain EAGLE feature
            self.img_fc.weight.zero_()
            self.img_fc.weight[:, :hidden_size] = torch.eye(hidden_size)
            self.img_fc.bias.zero_()
        self.global_feature: torch.Tensor | None = None  # [R, H] g of the rows being decoded (set by begin)

    def compress(self, image_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """image_embeds [N, T, H] -> (compressed token c [N, H], global feature g [N, H])."""
        out = self.adaptor(image_embeds.to(self.fc.weight.dtype))
        return out[:, 0], out[:, 1]

    def with_global(self, features: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """img_fc([features ; g]): features [R, S, H], g [R, H] -> [R, S, H]."""
        g = g.to(features.dtype).unsqueeze(1).expand_as(features)
        return self.img_fc(torch.cat([features, g], dim=-1))

    @torch.no_grad()
    def forward_cached(self, tokens, positions, cache, slots, mask, *, features, embeds=None):
        """As EagleVLM's; after `begin`, the features of decoded (text) elements are fused with g first."""
        if self.global_feature is not None:
            features = self.with_global(features, self.global_feature)
        return super().forward_cached(tokens, positions, cache, slots, mask, features=features, embeds=embeds)


def vispec_layout(drafter: VLMViSpecDrafter, input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                  image_token_id: int, shortcut_features: torch.Tensor | None = None,
                  text_only: bool = False) -> dict[str, torch.Tensor]:
    """The drafter's inputs for sequences [B, L] (exactly one image run per row): pairs (e_i, f_{i-1}) at positions
    i = 1..L-1 with the run [s, e] replaced by one element (c, f_{e-1}) at position e, and img_fc([f ; g]) on the
    text after it. `shortcut_features` [B, L, H] (optional) replaces f_{i-1} after the image (the anti-shortcut
    pass); `text_only` drops the whole run and g (training stage 1: the text pairs alone). Returns embeds,
    features, positions [B, L'] (L' = L - T_img, or L - T_img - 1 text-only), `source` [B, L'] (the original
    position i of each element: its target is f_i) and g [B, H]."""
    b, length = input_ids.shape
    is_image = input_ids == image_token_id  # [B, L]
    count = is_image.sum(-1)
    check(bool((count == count[0]).all()) and int(count[0]) >= 1,
          "ViSpec expects exactly one image run of the same length in every row.")
    t_img = int(count[0])
    start = is_image.float().argmax(-1)  # [B] first image position s
    end = start + t_img - 1  # [B] e
    image_embeds = embeds[is_image].view(b, t_img, -1)  # [B, T, H]
    c, g = drafter.compress(image_embeds)  # [B, H] each
    keep = torch.arange(1, length, device=input_ids.device).unsqueeze(0).expand(b, -1)  # [B, L-1] positions i
    kept = (keep < start.unsqueeze(-1)) | (keep > end.unsqueeze(-1) if text_only else keep >= end.unsqueeze(-1))
    source = keep[kept].view(b, -1)  # [B, L'] original positions
    pair_embeds = embeds.gather(1, source.unsqueeze(-1).expand(-1, -1, embeds.shape[-1]))  # e_i
    pair_features = features.gather(1, (source - 1).unsqueeze(-1).expand(-1, -1, features.shape[-1]))  # f_{i-1}
    after = source > end.unsqueeze(-1)  # [B, L'] text after the image
    if shortcut_features is not None:
        own = shortcut_features.gather(1, (source - 1).unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        pair_features = torch.where(after.unsqueeze(-1), own, pair_features)
    is_c = source == end.unsqueeze(-1)
    pair_embeds = torch.where(is_c.unsqueeze(-1), c.unsqueeze(1).to(pair_embeds.dtype), pair_embeds)
    if not text_only:
        fused = drafter.with_global(pair_features, g)
        pair_features = torch.where(after.unsqueeze(-1), fused, pair_features.to(fused.dtype))
    return {"embeds": pair_embeds, "features": pair_features, "positions": source, "source": source, "g": g,
            "image_tokens": torch.full((b,), t_img)}


class VLMViSpecTreeDrafter(VLMEagleTreeDrafter):
    """EAGLE-2 trees from a ViSpec drafter: `begin` compresses each row's image, runs the short prompt layout
    into the drafter's cache and sets g and the per-row position offsets."""

    def __init__(self, drafter: VLMViSpecDrafter, target: LlavaCachedLM, params: SamplingParams, *,
                 top_k: int = DEFAULT_TOP_K, depth: int = DEFAULT_DEPTH, total_tokens: int = DEFAULT_TOTAL_TOKENS):
        super().__init__(drafter, target, params, top_k=top_k, depth=depth, total_tokens=total_tokens)

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
        t_img = int(layout["image_tokens"][0])
        short = p - t_img  # drafter entries of the longest prompt (P - 1 pairs, T_img - 1 fewer)
        capacity = short + state.max_new_tokens + self.width + self.max_pool
        cache = drafter.new_cache(b, capacity)
        self.runner.cache = cache
        slots = cache.slots(short)  # [B, L']
        drafter.forward_cached(None, layout["positions"], cache, slots, cache.attention_mask(slots),
                               features=layout["features"], embeds=layout["embeds"])
        self.runner.forwards += 1
        self.runner.commit_chain(lengths - t_img)  # each row: its P_b - 1 pairs minus the T_img - 1 dropped
        self.position_offset = torch.full((b,), t_img, dtype=torch.long, device=features.device)
        drafter.global_feature = layout["g"]  # every decoded element is text after the image
        last = (lengths - 1).view(b, 1, 1).expand(-1, -1, features.shape[-1])
        self.pending = PendingPairs(state.last_token, features.gather(1, last)[:, 0], self.width)


VLMViSpecDrafter.loop_drafter = VLMViSpecTreeDrafter  # what the loop runs for this drafter model
