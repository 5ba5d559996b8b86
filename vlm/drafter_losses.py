"""The per-step losses of `mmspec train vlm-drafter` (`vlm.train_drafter`), one per drafter kind (`LOSSES`), each
over a batch the frozen target has just run (`vlm.target.prefill_vlm`: its merged input embeddings e, final normed
features f and, for EAGLE-3, the inputs of the layers it fuses) and returning (loss, three detached figures the
trainer logs). The papers' recipes: EagleVLM / MSD (`eagle_loss`), ViSpec's two stages and anti-shortcut pass
(`vispec_loss`), SpecVLM's gated compressor with online distillation (`specvlm_loss`), EAGLE-3's training-time test
(`eagle3_loss`, over ViSpec's layout with the vision adaptor)."""

from __future__ import annotations

from functools import partial

import torch

from mmspec.eagle3 import TTT_STEPS, ttt_loss
from mmspec.feature_drafter import distribution_l1_loss, feature_drafter_loss, feature_smoothl1
from vlm.target import VLMInputs


def feature_noise(features: torch.Tensor, lengths: torch.Tensor, width: float, scaling: str,
                  generator: torch.Generator) -> torch.Tensor:
    """Uniform noise for the input features [B, T, H] (only their shape and dtype are read: a meta tensor gives a
    data-parallel batch's whole shape), on the CPU: (U - 0.5) * width * 512 / L_b for a row of L_b tokens (EAGLE's
    code, scaling "eagle"), or (U - 0.5) * width (scaling "fixed")."""
    scale = torch.full(lengths.shape, float(width))  # [B]
    if scaling == "eagle":
        scale = scale * 512 / lengths.float()
    noise = (torch.rand(features.shape, generator=generator) - 0.5) * scale.view(-1, 1, 1)
    return noise.to(features.dtype)


def eagle_loss(drafter, lm, inputs: VLMInputs, loss_mask: torch.Tensor, noise: torch.Tensor, p_weight: float,
               step_kind: str, decoupled: bool = False, **batch) -> tuple[torch.Tensor, ...]:
    """EagleVLM: pairs (e_{i+1}, f_i + noise) over the full sequence predict f_{i+1}. `decoupled` (MSD): image
    positions enter as their raw visual embedding; a text-only batch (MSD's stage "text", no image in the
    target's run) is then the plain EAGLE pairs."""
    features, embeds = lm.last_hidden, lm.prompt_embeds  # [B, T, H]
    direct = inputs.input_ids[:, 1:] == lm.image_token_id if decoupled else None  # [B, T-1] pair i + 1
    pred = drafter(embeds[:, 1:], features[:, :-1] + noise[:, :-1], direct=direct)  # [B, T-1, H]
    next_logits = lm.model.lm_head(features[:, 1:]).float()  # [B, T-1, V]
    return feature_drafter_loss(pred, features[:, 1:], next_logits, drafter.head, p_weight, loss_mask)


def vispec_loss(drafter, lm, inputs: VLMInputs, loss_mask: torch.Tensor, noise: torch.Tensor, p_weight: float,
                step_kind: str, **batch) -> tuple[torch.Tensor, ...]:
    """ViSpec (`vlm.vispec`): stage "text" (a batch without images) SmoothL1 + p_weight * (soft CE + 0.1 ranking
    loss); stage "multimodal" 10 L1(p_draft - p_target) + 0.1 ranking loss, averaged over the plain pass and the
    anti-shortcut pass (the drafter's own first-pass features, shifted right, at every element but the first;
    gradients through both). The reported feature SmoothL1 is measured in both stages."""
    from vlm.vispec import vispec_layout

    features, embeds = lm.last_hidden, lm.prompt_embeds  # [B, T, H]
    ids, lengths = inputs.input_ids, inputs.lengths
    layout = vispec_layout(drafter, ids, embeds, features + noise, lm.image_token_id)
    source = layout["source"]  # [B, L'] original position i of each element: it predicts f_i
    valid = layout["valid"] & (source < lengths.unsqueeze(-1))
    index = source.unsqueeze(-1).expand(-1, -1, features.shape[-1])
    targets = features.gather(1, index)  # f_i
    next_logits = lm.model.lm_head(targets).float()
    pair_mask = loss_mask.gather(1, source - 1) & valid  # pair i -> loss-mask column i - 1
    pred = drafter(layout["embeds"], layout["features"], layout["positions"], valid, layout["direct"])
    if step_kind == "text":
        return feature_drafter_loss(pred, targets, next_logits, drafter.head, p_weight, pair_mask, rank_weight=0.1)
    own = torch.zeros_like(features, dtype=pred.dtype).scatter(1, index, pred)  # own[i] = predicted f_i
    layout2 = vispec_layout(drafter, ids, embeds, features + noise, lm.image_token_id, shortcut_features=own)
    pred2 = drafter(layout2["embeds"], layout2["features"], layout2["positions"], valid, layout2["direct"])
    loss1, l1, rank, agree = distribution_l1_loss(pred, next_logits, drafter.head, pair_mask)
    loss2 = distribution_l1_loss(pred2, next_logits, drafter.head, pair_mask)[0]
    smooth = feature_smoothl1(pred.detach(), targets, pair_mask)
    return (loss1 + loss2) / 2, smooth, l1, agree


def specvlm_loss(drafter, lm, inputs: VLMInputs, loss_mask: torch.Tensor, noise: torch.Tensor, p_weight: float,
                 step_kind: str, **batch) -> tuple[torch.Tensor, ...]:
    """SpecVLM: the gate picks a primitive per row (straight-through Gumbel-softmax) and the layout holds its tokens;
    online distillation from the target running on this very batch (features + logits)."""
    from vlm.specvlm import specvlm_layout

    features, embeds = lm.last_hidden, lm.prompt_embeds  # [B, T, H]
    layout = specvlm_layout(drafter, inputs.input_ids, embeds, features + noise, inputs.lengths,
                            batch["prompt_lengths"], lm.image_token_id, train=True, generator=batch["generator"],
                            image_grids=lm.image_grids(inputs, embeds))
    source, valid = layout["source"].clamp_min(1), layout["valid"]
    h = features.shape[-1]
    targets = features.gather(1, source.unsqueeze(-1).expand(-1, -1, h))  # f_source
    next_logits = lm.model.lm_head(targets).float()
    mask = loss_mask.gather(1, source - 1) & valid
    pred = drafter(layout["embeds"], layout["features"], layout["positions"], valid)
    return feature_drafter_loss(pred, targets, next_logits, drafter.head, p_weight, mask)


def eagle3_loss(drafter, lm, inputs: VLMInputs, loss_mask: torch.Tensor, noise: torch.Tensor, p_weight: float,
                step_kind: str, ttt_steps: int = TTT_STEPS, **batch) -> tuple[torch.Tensor, ...]:
    """EAGLE-3 (`mmspec.eagle3.ttt_loss`): pairs (fused layer inputs a_i, e_{i+1}) over the full sequence, the
    training-time test unrolled `ttt_steps` steps against the target's distributions (soft cross-entropy alone, as
    EAGLE-3 trains: no feature regression, no feature noise: the drafter learns from its own outputs instead)."""
    if drafter.vision_adaptor:
        return eagle3_adaptor_loss(drafter, lm, inputs, loss_mask, ttt_steps)
    target_logits = lm.model.lm_head(lm.last_hidden[:, 1:]).float()  # [B, T-1, V] the target's of token i + 2
    valid = inputs.attention_mask[:, 1:].bool()  # [B, T-1]
    return ttt_loss(drafter, lm.prompt_embeds[:, 1:], lm.last_aux[:, :-1], target_logits, loss_mask, ttt_steps,
                    valid=valid)


def eagle3_adaptor_loss(drafter, lm, inputs: VLMInputs, loss_mask: torch.Tensor,
                        ttt_steps: int) -> tuple[torch.Tensor, ...]:
    """EAGLE-3 with ViSpec's vision adaptor (`vlm.eagle3`): the training-time test over ViSpec's layout, element s
    (position s) pairing e_s with img_fc([fc(a_{s-1}) ; g_s]) (the image run compressed, `vlm.vispec.vispec_layout`)
    and scored against the target's distribution of token s + 1; the drafter's outputs are fused with the row's g
    before a later step reads them, as its loop fuses the outputs it drafts from."""
    from vlm.vispec import vispec_layout

    layout = vispec_layout(drafter, inputs.input_ids, lm.prompt_embeds, lm.last_aux, lm.image_token_id)
    source = layout["source"]  # [B, L'] element -> its position s in the sequence
    valid = layout["valid"] & (source < inputs.lengths.unsqueeze(-1))  # [B, L']
    h = lm.last_hidden.shape[-1]
    target_logits = lm.model.lm_head(lm.last_hidden.gather(1, source.unsqueeze(-1).expand(-1, -1, h))).float()
    mask = loss_mask.gather(1, source - 1) & valid  # element s is pair s - 1 of the plain layout
    g = layout["g"]  # [B, H] (0 in rows without an image)
    return ttt_loss(drafter, layout["embeds"], layout["features"], target_logits, mask, ttt_steps, valid=valid,
                    positions=source, direct=layout["direct"], later_features=lambda o: drafter.with_global(o, g))


LOSSES = {"eagle": eagle_loss, "vispec": vispec_loss, "msd": partial(eagle_loss, decoupled=True),
          "specvlm": specvlm_loss, "eagle3": eagle3_loss}
