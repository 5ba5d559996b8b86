"""Stage `vision` of `mmspec train vlm`: pretrain the world target's vision tower (the LLaVA's CLIP tower, or with
`--arch qwen2_vl` Qwen2-VL's tower and patch merger) on the world's scene labels.

LLaVA starts from a pretrained CLIP tower and keeps it frozen while the projector and the language model learn. The
world has no CLIP, and a tower learned only through the answer loss learns colours and counts but barely tells
shapes apart (the first shipped target: shape answers 0.379, chance 0.25, even for large objects: 0.30), and binds
attributes to positions poorly (two-object colour questions about 0.7). So this stage gives the tower its
pretraining, supervised densely by what each scene is made of: every image token learns what it shows.

    features = tower(pixels).hidden_states[vision_feature_layer][:, 1:]    # [B, P, D], what the projector reads
    per image token (patch), one linear head over its feature:
        the object covering the patch centre (inside its bounding box): its shape, colour, size and grid cell,
        or "none" for each when the patch shows background               # [B, P, 5], [B, P, 5], [B, P, 4], [B, P, 10]
    background colour (from the mean feature [B, D])                       # [B, 6]

Each token then carries its object's shape, colour, size and place where the language model can read it with one
attention hop ("the object in the upper left" finds the tokens that say "cell 0"). The heads read the hidden layer
the projector reads (layer -2 by default, CLS dropped), so the features the language model sees are the trained
ones; the heads are thrown away afterwards. Qwen2-VL's tower is read at its merged output (its merger is
LLaVA's projector): one token per 2x2 patches, a 4x4 grid for a 32x32 image (`world_tower`). Fresh scenes every
step (one- and two-object scenes, like the VQA data), AdamW, the world trainers' schedule. Measured on held-out test
scenes: the readout's accuracy per attribute over the covered patches, on the empty patches, and for the background.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from mmspec.data import generate_batch
from mmspec.data.world import BACKGROUNDS, BASE_SIZE, COLORS, SHAPES, SIZES, UNITS_PER_PIXEL
from mmspec.world_training import optimizer_step

CELLS = 9  # the world's 3x3 grid
IMAGE_SIDE = 32  # world images are 32x32
ATTRIBUTES = {"shape": len(SHAPES), "color": len(COLORS), "size": len(SIZES), "cell": CELLS}  # before "none"


def patch_targets(params, patches_per_side: int) -> dict[str, torch.Tensor]:
    """Per-patch labels of a batch of scenes (`SceneParams`): shape / color / size / cell [N, P] int64 (P =
    patches_per_side ** 2, raster order): the attribute of the object whose bounding box holds the patch centre, or
    the attribute's "none" class (its number of classes); background [N]. Objects never overlap."""
    span = BASE_SIZE * UNITS_PER_PIXEL  # the image side in geometry units
    centres = (np.arange(patches_per_side) * 2 + 1) * span // (2 * patches_per_side)  # [S] patch centres
    px, py = np.meshgrid(centres, centres)  # [S, S] x by column, y by row
    px, py = px.reshape(1, -1), py.reshape(1, -1)  # [1, P]
    n, p = len(params), px.shape[1]
    out = {name: np.full((n, p), classes, dtype=np.int64) for name, classes in ATTRIBUTES.items()}
    for obj in range(params.cell.shape[1]):
        present = (params.cell[:, obj] >= 0)[:, None]  # [N, 1]
        half = params.half[:, obj:obj + 1]  # [N, 1]
        inside = present & (np.abs(px - params.cx[:, obj:obj + 1]) <= half) & (
            np.abs(py - params.cy[:, obj:obj + 1]) <= half)  # [N, P]
        for name in ATTRIBUTES:
            value = np.broadcast_to(getattr(params, name)[:, obj:obj + 1], (n, p))
            out[name] = np.where(inside, value, out[name])
    targets = {name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in out.items()}
    targets["background"] = torch.from_numpy(params.background.astype(np.int64))
    return targets


class SceneReadout(nn.Module):
    """Linear heads from each image token's feature to its patch labels, and from the mean feature to the
    background (see the module docstring)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.patch = nn.Linear(hidden_size, sum(classes + 1 for classes in ATTRIBUTES.values()))
        self.background = nn.Linear(hidden_size, len(BACKGROUNDS))

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.patch(features)  # [B, P, sum(C + 1)]
        out = dict(zip(ATTRIBUTES, logits.split([c + 1 for c in ATTRIBUTES.values()], dim=-1)))  # [B, P, C+1]
        out["background"] = self.background(features.mean(1))  # [B, 6]
        return out


def tower_features(tower: nn.Module, pixel_values: torch.Tensor, layer: int) -> torch.Tensor:
    """The patch features the projector reads, one per patch (strategy "default": CLS dropped), which the patch
    labels describe. [B, 3, H, W] -> [B, P, D]."""
    return vision_features(tower, pixel_values, layer, "default")


def _batch(processor, n: int, seed: int, split: str, start: int, two_objects: float, patches_per_side: int):
    """(the processor's image inputs: pixel_values and, for Qwen2-VL, image_grid_thw; the patch labels)."""
    batch = generate_batch(n, seed, split=split, start=start, two_objects=two_objects, with_text=False)
    images = dict(processor.image_processor(list(batch.images), return_tensors="pt"))  # pixel_values [n, 3, 32, 32]
    return images, patch_targets(batch.params, patches_per_side)


def world_tower(vision_config, layer: int) -> tuple[nn.Module, int, int, Callable]:
    """A fresh vision tower for `vision_config` and how to read it: (tower, image tokens per side, feature size,
    features(tower, image inputs) -> [B, P, D]). CLIP (LLaVA): the hidden layer `layer` the projector reads, one
    token per patch; Qwen2-VL: the tower's merged output (its merger is LLaVA's projector), one token per 2x2
    patches, raster order."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    if isinstance(vision_config, CLIPVisionConfig):
        side = vision_config.image_size // vision_config.patch_size
        return (CLIPVisionModel(vision_config), side, vision_config.hidden_size,
                lambda tower, images: tower_features(tower, images["pixel_values"], layer))
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    def merged(tower, images):
        grid = images["image_grid_thw"]  # [B, 3]
        out = tower(images["pixel_values"], grid_thw=grid).pooler_output  # [sum tokens, D]
        return out.view(grid.shape[0], -1, out.shape[-1])

    side = IMAGE_SIDE // (vision_config.patch_size * vision_config.spatial_merge_size)
    return Qwen2VisionTransformerPretrainedModel(vision_config), side, vision_config.hidden_size, merged


def readout_loss(logits: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over the attributes of the mean cross-entropy (every patch counts, background patches included)."""
    return sum(nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), targets[name].reshape(-1))
               for name, x in logits.items())


@torch.no_grad()
def readout_accuracy(tower: nn.Module, readout: SceneReadout, processor, features: Callable, n: int, seed: int,
                     two_objects: float, patches_per_side: int) -> dict[str, float]:
    """Accuracy of the readout on n held-out test scenes: per attribute over the patches an object covers, "none" on
    the background patches, and the background colour."""
    was_training = tower.training
    tower.eval()
    images, targets = _batch(processor, n, seed, "test", 0, two_objects, patches_per_side)
    logits = readout(features(tower, images))
    covered = targets["shape"] < ATTRIBUTES["shape"]  # [n, P]
    right = {name: logits[name].argmax(-1) == targets[name] for name in ATTRIBUTES}  # [n, P] each
    acc = {name: right[name][covered].float().mean().item() for name in ATTRIBUTES}
    acc["empty_patches"] = torch.stack(list(right.values())).all(0)[~covered].float().mean().item()
    acc["background"] = (logits["background"].argmax(-1) == targets["background"]).float().mean().item()
    tower.train(was_training)
    return acc


def pretrain_vision_tower(vision_config, layer: int, processor, steps: int, batch_size: int, lr: float, seed: int,
                          two_objects: float, quiet: bool, eval_scenes: int = 512) -> tuple[dict, dict]:
    """A fresh vision tower (`vision_config`: CLIP or Qwen2-VL's, `world_tower`) pretrained on the scene labels;
    returns (its state dict, info with the held-out readout accuracy)."""
    torch.manual_seed(seed)
    tower, side, hidden, features = world_tower(vision_config, layer)
    tower.train()
    readout = SceneReadout(hidden)
    params = list(tower.parameters()) + list(readout.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="vision tower", disable=quiet)
    for step in bar:
        images, targets = _batch(processor, batch_size, seed, "train", step * batch_size, two_objects, side)
        loss = readout_loss(readout(features(tower, images)), targets)
        optimizer_step(opt, loss, step, steps, lr)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    seconds = time.perf_counter() - start
    accuracy = readout_accuracy(tower, readout, processor, features, eval_scenes, seed, two_objects, side)
    info = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "two_objects": two_objects,
            "feature_layer": layer, "seconds": seconds, "eval_scenes": eval_scenes, "readout_accuracy": accuracy}
    return tower.eval().state_dict(), info


def vision_features(tower, pixel_values: torch.Tensor, layer: int | list[int], strategy: str) -> torch.Tensor:
    """What a LLaVA projector reads (transformers' selection): the vision tower's hidden state(s) `layer`, the CLS
    token dropped when `strategy` is "default", concatenated over the layers. [N, 3, H, W] -> [N, P, Hv * layers]."""
    vision = tower(pixel_values, output_hidden_states=True)
    layers = [layer] if isinstance(layer, int) else list(layer)
    selected = [vision.hidden_states[i] for i in layers]  # each [N, 1 + patches, Hv]
    if strategy == "default":
        selected = [h[:, 1:] for h in selected]  # drop CLS
    return torch.cat(selected, dim=-1)
