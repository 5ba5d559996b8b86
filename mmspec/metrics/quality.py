"""Quality figures of generated world images, measured by the world judge: class accuracy and world-FID.

- `class_accuracy(images, labels)`: fraction of images the judge classifies as their intended class.
- `world_fid(generated, reference)`: Frechet distance between Gaussian fits of judge features (the
  penultimate layer, 64-d) of generated images and of held-out real world images. The sample counts are always
  returned with it: FID is biased upwards for small samples, so compare figures measured with the same counts.
- `world_reference_stats(n, seed, image_size)`: the reference Gaussian from `n` held-out (test-split) images.

Images are [N, 3, H, W], uint8 (0..255) or float in [0, 1]; `judge=None` uses the shipped `assets/judge`.
The Frechet distance is computed in float64 with eigen-decompositions, which stay real and stable for
singular or ill-conditioned covariances (no complex `sqrtm` round-off to discard).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from mmspec.errors import InputError, check, check_positive_int
from mmspec.metrics.judge import WorldJudge, resolve_judge

JudgeLike = WorldJudge | str | os.PathLike | None


@dataclass(frozen=True)
class FIDResult:
    """A Frechet distance with the number of samples on each side."""

    fid: float
    n_generated: int
    n_reference: int

    def __str__(self) -> str:
        return f"FID {self.fid:.3f} (n_generated={self.n_generated}, n_reference={self.n_reference})"


@dataclass(frozen=True)
class ReferenceStats:
    """Mean [F] and covariance [F, F] (float64) of judge features of `n` images."""

    mu: np.ndarray
    sigma: np.ndarray
    n: int


# --------------------------------------------------------------------------------------------- checks
def check_images(name: str, images: torch.Tensor, min_count: int = 1) -> torch.Tensor:
    """Validate [N, 3, H, W] uint8 or [0, 1] float images; returns them (numpy arrays become tensors)."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    check(
        isinstance(images, torch.Tensor),
        f"{name} must be a torch.Tensor [N, 3, H, W], got {type(images).__name__}.",
    )
    check(
        images.dim() == 4 and images.shape[1] == 3,
        f"{name} has shape {list(images.shape)}, expected [N, 3, H, W] (channels first; for [N, H, W, 3] use "
        ".permute(0, 3, 1, 2)).",
    )
    check(
        images.shape[0] >= min_count, f"{name} holds {images.shape[0]} image(s), at least {min_count} needed."
    )
    if images.dtype == torch.uint8:
        return images
    check(images.is_floating_point(), f"{name} must be uint8 or floating point, got dtype {images.dtype}.")
    lo, hi = float(images.min()), float(images.max())
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise InputError(f"{name} contains NaN or inf values.")
    if lo < -1e-3 or hi > 1 + 1e-3:
        hint = " It looks like [-1, 1]: pass (images + 1) / 2." if lo < -1e-3 and hi <= 1 + 1e-3 else ""
        hint = hint or " If they are 0..255 values, pass images.to(torch.uint8)."
        raise InputError(
            f"{name} must be in [0, 1] when floating point, got values in [{lo:.3g}, {hi:.3g}].{hint}"
        )
    return images


# --------------------------------------------------------------------------------------------- features
@torch.no_grad()
def judge_features(images: torch.Tensor, judge: JudgeLike = None, batch_size: int = 1000) -> torch.Tensor:
    """[N, F] float32 judge features (penultimate layer) of images, computed in batches on the
    judge's device."""
    images = check_images("images", images)
    check_positive_int("batch_size", batch_size)
    model = resolve_judge(judge)
    device = next(model.parameters()).device
    parts = [
        model.features(images[s : s + batch_size].to(device)).float().cpu()
        for s in range(0, images.shape[0], batch_size)
    ]
    return torch.cat(parts)


@torch.no_grad()
def judge_predictions(images: torch.Tensor, judge: JudgeLike = None, batch_size: int = 1000) -> torch.Tensor:
    """[N] int64 classes the judge assigns."""
    images = check_images("images", images)
    check_positive_int("batch_size", batch_size)
    model = resolve_judge(judge)
    device = next(model.parameters()).device
    parts = [
        model(images[s : s + batch_size].to(device)).argmax(-1).cpu()
        for s in range(0, images.shape[0], batch_size)
    ]
    return torch.cat(parts)


def class_accuracy(images: torch.Tensor, labels: torch.Tensor, judge: JudgeLike = None) -> float:
    """Fraction of `images` the judge classifies as `labels` ([N] ints in [0, NUM_CLASSES))."""
    from mmspec.data.world import NUM_CLASSES

    images = check_images("images", images)
    labels = torch.as_tensor(labels)
    check(
        labels.dim() == 1 and labels.shape[0] == images.shape[0] and not labels.is_floating_point(),
        f"labels must be [N] integers with N = {images.shape[0]} (one per image), got {labels.dtype} "
        f"{list(labels.shape)}.",
    )
    check(bool(((labels >= 0) & (labels < NUM_CLASSES)).all()), f"labels must be in [0, {NUM_CLASSES}).")
    pred = judge_predictions(images, judge)
    return float((pred == labels.cpu().long()).double().mean())


def attribute_agreement(images: torch.Tensor, scenes, judge: JudgeLike = None, batch_size: int = 1000) -> dict:
    """How often the judge reads each attribute of `scenes` (a single-object `WorldBatch`, whose captions name the
    attributes, or its `scene_targets`) in `images` [N, 3, H, W]: {"attributes": {shape, colour, size, position,
    background: rate}, "all_attributes": the rate at which all five agree}."""
    from mmspec.data.world import NUM_COLORS
    from mmspec.metrics.train_judge import scene_targets

    images = check_images("images", images)
    want = scenes if isinstance(scenes, dict) else scene_targets(scenes)  # each [N]
    check(want["class"].shape[0] == images.shape[0],
          f"one scene per image: {want['class'].shape[0]} scenes for {images.shape[0]} images.")
    model = resolve_judge(judge)
    device = next(model.parameters()).device
    heads = [model.heads(images[s:s + batch_size].to(device)) for s in range(0, images.shape[0], batch_size)]
    read = {k: torch.cat([h[k] for h in heads]).argmax(-1).cpu() for k in heads[0]}  # each [N]
    hits = {"shape": read["class"] // NUM_COLORS == want["class"] // NUM_COLORS,
            "colour": read["class"] % NUM_COLORS == want["class"] % NUM_COLORS,
            **{k: read[k] == want[k] for k in ("size", "position", "background")}}
    every = torch.stack(list(hits.values())).all(0)
    return {"attributes": {k: float(v.double().mean()) for k, v in hits.items()},
            "all_attributes": float(every.double().mean())}


# --------------------------------------------------------------------------------------------- FID
def gaussian_stats(features: torch.Tensor | np.ndarray) -> ReferenceStats:
    """Mean and (unbiased) covariance in float64 of [N, F] features, N >= 2."""
    f = np.asarray(features.cpu() if isinstance(features, torch.Tensor) else features, dtype=np.float64)
    check(f.ndim == 2 and f.shape[0] >= 2, f"features must be [N, F] with N >= 2, got shape {list(f.shape)}.")
    return ReferenceStats(
        mu=f.mean(0), sigma=np.cov(f, rowvar=False).reshape(f.shape[1], f.shape[1]), n=f.shape[0]
    )


def _psd_sqrt(a: np.ndarray) -> np.ndarray:
    """Symmetric square root of a (numerically) positive semi-definite matrix."""
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr((S1^1/2 S2 S1^1/2)^1/2), in float64, clipped at 0."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    check(mu1.shape == mu2.shape and mu1.ndim == 1, f"mu1 {mu1.shape} and mu2 {mu2.shape} must be equal [F].")
    f = mu1.shape[0]
    check(
        s1.shape == (f, f) and s2.shape == (f, f),
        f"sigma1 {s1.shape} and sigma2 {s2.shape} must be [F, F], F={f}.",
    )
    r1 = _psd_sqrt(s1)
    middle = r1 @ s2 @ r1  # similar to S1 S2, symmetric PSD: its eigenvalues are those of S1 S2
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(max(0.0, diff @ diff + np.trace(s1) + np.trace(s2) - 2 * tr_covmean))


def world_reference_stats(
    n: int = 5000,
    seed: int = 0,
    image_size: int = 32,
    judge: JudgeLike = None,
    split: str = "test",
    two_objects: float = 0.0,
) -> ReferenceStats:
    """Judge-feature Gaussian of `n` held-out real world images (test split by default)."""
    from mmspec.data.dataset import generate_batch

    check_positive_int("n", n, minimum=2)
    check(split in ("val", "test"), f"split must be a held-out split, 'val' or 'test', got {split!r}.")
    model = resolve_judge(judge)
    feats = []
    for start in range(0, n, 2000):
        batch = generate_batch(
            min(2000, n - start),
            seed,
            split=split,
            start=start,
            image_size=image_size,
            two_objects=two_objects,
            with_text=False,
        )
        feats.append(judge_features(batch.images, model))
    return gaussian_stats(torch.cat(feats))


def world_fid(
    generated: torch.Tensor,
    reference: torch.Tensor | ReferenceStats,
    judge: JudgeLike = None,
) -> FIDResult:
    """Frechet distance in judge-feature space between `generated` images and `reference`.

    `reference` is either images ([M, 3, H, W], real held-out world images) or `world_reference_stats(...)`.
    Both sides need at least 2 images; use hundreds to thousands (and the same counts when comparing).
    """
    generated = check_images("generated", generated, min_count=2)
    model = resolve_judge(judge)
    gen = gaussian_stats(judge_features(generated, model))
    if isinstance(reference, ReferenceStats):
        ref = reference
        check(
            ref.mu.shape == gen.mu.shape,
            f"reference stats have {ref.mu.shape[0]} features, the judge gives "
            f"{gen.mu.shape[0]}; build them with the same judge.",
        )
    else:
        ref = gaussian_stats(judge_features(check_images("reference", reference, min_count=2), model))
    return FIDResult(
        fid=frechet_distance(gen.mu, gen.sigma, ref.mu, ref.sigma), n_generated=gen.n, n_reference=ref.n
    )
