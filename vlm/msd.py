"""MSD: an EAGLE drafter with decoupled inputs for text and image positions (from the MSD paper, arXiv 2505.14260;
Lyn-Lucy/MSD).

    text position:   x_t = fc([e_t ; f_{t-1}])     (EAGLE's fusion of the token embedding and the target feature)
    image position:  x_t = v_t                     (the raw projected visual embedding: no target feature, no fc)

then one decoder layer and the target's head, as EagleVLM (`vlm.eagle`, which this subclasses). The drafter's
sequence is the target's full sequence with true positions; only the prompt can hold image positions, so the
difference is in `begin`'s prompt pass (`prompt_inputs` gives the image mask) and in training.

Training (`mmspec train vlm-drafter --kind msd`) follows MSD's two-stage schedule, mapped from its 40 epochs onto
the run's steps: the first half text-only (the image run removed from the drafter's sequence, true positions
kept), then each step is multimodal with probability (e - 20) / 20 at "epoch" e = 40 * step / steps, and the
last 2.5% always multimodal. MSD draws text-only vs visual per sample; here a whole step's batch is one or the
other (our batches share one layout), a documented simplification.
"""

from __future__ import annotations

import torch

from mmspec.tree import levels_of_eagle_depth
from vlm.eagle import VLMEagleDrafter, VLMEagleTreeDrafter
from vlm.target import VLMInputs

# MSD's tree: EAGLE's depth 5 (6 draft levels), top_k 10, total 59
MSD_TREE = (levels_of_eagle_depth(5), 10, 59)


class VLMMSDDrafter(VLMEagleDrafter):
    """EagleVLM with MSD's decoupled inputs: image positions enter the layer as their raw visual embedding
    (`direct`, see `vlm.eagle`)."""

    official_tree = MSD_TREE  # its training forward is EagleVLM's with direct = the image positions


class VLMMSDTreeDrafter(VLMEagleTreeDrafter):
    """EAGLE-2 trees from an MSD drafter: the prompt pass marks image positions."""

    def prompt_inputs(self, inputs: VLMInputs) -> dict:
        ids = inputs.input_ids.to(self.target.device)
        return {"direct": ids[:, 1:] == self.target.image_token_id}  # pairs (f_j, e_{j+1}): position j + 1


def text_pair_positions(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Positions i >= 1 of the non-image tokens of sequences [B, L] (every row holds the same number of image
    tokens) -> [B, L'] : the pairs of a text-only pass, at their true positions."""
    keep = input_ids[:, 1:] != image_token_id  # [B, L-1] pair at position i = column i - 1
    counts = keep.sum(-1)
    assert bool((counts == counts[0]).all()), "rows hold different numbers of image tokens"
    positions = torch.arange(1, input_ids.shape[1], device=input_ids.device).expand_as(keep)
    return positions[keep].view(input_ids.shape[0], -1)


def msd_visual_probability(step: int, steps: int) -> float:
    """MSD's schedule on `steps`: epoch e = 40 step / steps; 0 for e < 20, (e - 20) / 20 up to 39, then 1."""
    epoch = 40.0 * step / max(1, steps)
    if epoch < 20:
        return 0.0
    if epoch >= 39:
        return 1.0
    return (epoch - 20) / 20


VLMMSDDrafter.loop_drafter = VLMMSDTreeDrafter  # what the loop runs for this drafter model
