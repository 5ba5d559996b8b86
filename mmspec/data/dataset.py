"""The world as batches and as a torch `Dataset`.

`generate_batch(n, seed, split=..., start=...)` makes samples `start .. start + n - 1` of the (seed, split)
stream in one vectorised pass; `WorldDataset` serves the same samples one by one (it renders them in cached
chunks through `generate_batch`), so `WorldDataset(split, seed=s)[i]` equals row `i` of
`generate_batch(i + 1, s, split=split)` byte for byte.

Images are **uint8 `[N, 3, H, W]`** (RGB, 0..255) everywhere in this module; `images_to_float` turns them
into float32 in `[0, 1]` (what the judge and most models take) and `images_to_uint8` goes back (rounding).

A sample's `label` is the class of its first object (`class_index(shape, colour)`); in two-object scenes the
second object is described by the caption and QA but does not change the label. Class-conditional image models
train on single-object scenes (`two_objects=0.0`, the default).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmspec.data.text import QA, scene_text
from mmspec.data.world import IMAGE_SIZES, SPLITS, SceneParams, render, sample_scenes
from mmspec.errors import InputError, check, check_positive_int

MAX_SEED = 2**63 - 1


@dataclass
class WorldBatch:
    """N world samples. `images` uint8 [N, 3, H, W]; `labels` int64 [N] (first object's class)."""

    images: torch.Tensor  # [N, 3, H, W] uint8
    labels: torch.Tensor  # [N] int64
    captions: list[str]
    qa: list[list[QA]]
    indices: torch.Tensor  # [N] int64, position of each sample in its (seed, split) stream
    params: SceneParams = field(repr=False)
    split: str = "train"
    seed: int = 0

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def float_images(self) -> torch.Tensor:
        """[N, 3, H, W] float32 in [0, 1]."""
        return images_to_float(self.images)

    def sample(self, row: int) -> dict[str, Any]:
        """Row `row` as the dict that `WorldDataset.__getitem__` returns."""
        return {
            "image": self.images[row],
            "label": int(self.labels[row]),
            "caption": self.captions[row] if self.captions else "",
            "qa": [q.to_dict() for q in self.qa[row]] if self.qa else [],
            "index": int(self.indices[row]),
        }


# --------------------------------------------------------------------------------------------- conversions
def images_to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (0..255) -> float32 in [0, 1]; float input is returned as float32 unchanged."""
    check(isinstance(images, torch.Tensor), f"images must be a torch.Tensor, got {type(images).__name__}.")
    if images.dtype == torch.uint8:
        return images.to(torch.float32) / 255.0
    check(images.is_floating_point(), f"images must be uint8 or floating point, got dtype {images.dtype}.")
    return images.to(torch.float32)


def images_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """float images in [0, 1] -> uint8 (clamped, rounded to nearest); uint8 input is returned unchanged."""
    check(isinstance(images, torch.Tensor), f"images must be a torch.Tensor, got {type(images).__name__}.")
    if images.dtype == torch.uint8:
        return images
    check(images.is_floating_point(), f"images must be uint8 or floating point, got dtype {images.dtype}.")
    return (images.clamp(0, 1) * 255.0).round().to(torch.uint8)


# --------------------------------------------------------------------------------------------- checks
def _check_world_args(seed: int, split: str, image_size: int, two_objects: float) -> None:
    check(
        isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and 0 <= int(seed) <= MAX_SEED,
        f"seed must be an integer in [0, 2**63), got {seed!r}.",
    )
    check(split in SPLITS, f"split must be one of {list(SPLITS)}, got {split!r}.")
    check(image_size in IMAGE_SIZES, f"image_size must be one of {list(IMAGE_SIZES)}, got {image_size!r}.")
    check(
        isinstance(two_objects, (int, float)) and 0.0 <= float(two_objects) <= 1.0,
        f"two_objects is the probability of a two-object scene and must be in [0, 1], got {two_objects!r}.",
    )


# --------------------------------------------------------------------------------------------- batches
def generate_batch(
    n: int,
    seed: int = 0,
    *,
    split: str = "train",
    start: int = 0,
    image_size: int = 32,
    two_objects: float = 0.0,
    with_text: bool = True,
) -> WorldBatch:
    """Samples `start .. start + n - 1` of the world stream (seed, split), vectorised over the batch.

    Returns uint8 images [n, 3, image_size, image_size], labels, captions and QA (`with_text=False` skips
    the text when only images and labels are needed).
    """
    check_positive_int("n", n)
    check(
        isinstance(start, int) and not isinstance(start, bool) and start >= 0,
        f"start must be an integer >= 0, got {start!r}.",
    )
    _check_world_args(seed, split, image_size, two_objects)
    indices = np.arange(start, start + n, dtype=np.int64)
    params = sample_scenes(indices, int(seed), split, image_size, float(two_objects))
    images = torch.from_numpy(render(params))
    captions: list[str] = []
    qa: list[list[QA]] = []
    if with_text:
        for row in range(n):
            cap, pairs = scene_text(params, row)
            captions.append(cap)
            qa.append(pairs)
    return WorldBatch(
        images=images,
        labels=torch.from_numpy(params.label.astype(np.int64)),
        captions=captions,
        qa=qa,
        indices=torch.from_numpy(indices),
        params=params,
        split=split,
        seed=int(seed),
    )


# --------------------------------------------------------------------------------------------- dataset
class WorldDataset(Dataset):
    """`size` samples of the (seed, split) world stream; item i is a dict.

    Item keys: "image" (uint8 [3, H, W]), "label" (int, first object's class), "caption" (str),
    "qa" (list of dicts with "kind", "question", "short", "long"), "index" (int). Use `collate_world` as the
    DataLoader's `collate_fn`. Splits are disjoint (see `mmspec.data.world`).
    """

    def __init__(
        self,
        split: str = "train",
        size: int = 10_000,
        seed: int = 0,
        image_size: int = 32,
        two_objects: float = 0.0,
        chunk_size: int = 512,
        cached_chunks: int = 8,
    ) -> None:
        check_positive_int("size", size)
        check_positive_int("chunk_size", chunk_size)
        check_positive_int("cached_chunks", cached_chunks)
        _check_world_args(seed, split, image_size, two_objects)
        self.split, self.size, self.seed = split, size, int(seed)
        self.image_size, self.two_objects = image_size, float(two_objects)
        self.chunk_size, self.cached_chunks = chunk_size, cached_chunks
        self._chunks: OrderedDict[int, WorldBatch] = OrderedDict()

    def __len__(self) -> int:
        return self.size

    def _chunk(self, c: int) -> WorldBatch:
        if c in self._chunks:
            self._chunks.move_to_end(c)
            return self._chunks[c]
        start = c * self.chunk_size
        batch = generate_batch(
            min(self.chunk_size, self.size - start),
            self.seed,
            split=self.split,
            start=start,
            image_size=self.image_size,
            two_objects=self.two_objects,
        )
        self._chunks[c] = batch
        if len(self._chunks) > self.cached_chunks:
            self._chunks.popitem(last=False)
        return batch

    def __getitem__(self, i: int) -> dict[str, Any]:
        if isinstance(i, (np.integer, torch.Tensor)):
            i = int(i)
        if not isinstance(i, int) or not -self.size <= i < self.size:
            raise IndexError(f"index {i!r} out of range for a WorldDataset of size {self.size}")
        i %= self.size
        return self._chunk(i // self.chunk_size).sample(i % self.chunk_size)

    def labels(self) -> torch.Tensor:
        """[size] int64 labels of every sample (renders nothing but the scene parameters)."""
        params = sample_scenes(np.arange(self.size), self.seed, self.split, self.image_size, self.two_objects)
        return torch.from_numpy(params.label.astype(np.int64))


def collate_world(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """DataLoader collate for `WorldDataset` items: stacks images and labels, keeps text as lists."""
    if not samples:
        raise InputError("samples must be a non-empty list of WorldDataset items.")
    return {
        "image": torch.stack([s["image"] for s in samples]),
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.int64),
        "caption": [s["caption"] for s in samples],
        "qa": [s["qa"] for s in samples],
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.int64),
    }
