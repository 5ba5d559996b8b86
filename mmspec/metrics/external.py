"""Adapters for standard metrics on real checkpoints: Inception FID (torch-fidelity), CLIP score (open_clip).

Both take a local weights file and never download anything:

- `inception_fid(generated, reference, weights_path)`: torch-fidelity's `inception-v3-compat` FID (the
  TF-Inception port that matches the reference FID implementation). `weights_path` is the converted weights
  file torch-fidelity uses (`weights-inception-2015-12-05-6726825d.pth`), or the same state dict saved as
  safetensors. It is loaded here safely (safetensors, or `torch.load(weights_only=True)`) and handed to
  torch-fidelity as a plain tensor file, with dataset downloads and its on-disk cache switched off.
- `clip_score(images, texts, model_name, weights_path)`: mean over pairs of max(100 * cos(image, text), 0)
  (the CLIPScore convention of torchmetrics). `model_name` must be an open_clip config known locally
  (built-in, or added with `open_clip.add_model_config`) whose tokenizer ships with open_clip; models that
  need a Hugging Face tokenizer or text tower (SigLIP, `hf_model_name` / `hf_tokenizer_name` configs) are
  refused because they would download.

Images: [N, 3, H, W] uint8 or float in [0, 1], or (for FID) a folder of PNG/JPEG files of one size.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from mmspec.errors import CheckpointError, InputError, check, check_positive_int, why_not_a_file
from mmspec.metrics.quality import FIDResult, check_images


def require_module(name: str, package: str):
    """Import an optional dependency of these adapters, or say how to install it (the `metrics` extra)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise InputError(f"this metric needs {package}: pip install 'mmspec[metrics]' (or pip install {package}).") \
            from None

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
# a few keys of torch-fidelity's Inception-v3 state dict, checked before the (slow) model construction
INCEPTION_KEY_SHAPES: dict[str, tuple[int, ...]] = {
    "Conv2d_1a_3x3.conv.weight": (32, 3, 3, 3),
    "Mixed_7c.branch_pool.conv.weight": (192, 2048, 1, 1),
    "fc.weight": (1008, 2048),
}


# --------------------------------------------------------------------------------------------- inputs
def check_weights_path(weights_path: str | os.PathLike | None, what: str) -> Path:
    """`weights_path` as an absolute Path to an existing file, else an InputError saying what to pass."""
    if weights_path is None or not isinstance(weights_path, (str, os.PathLike)) or str(weights_path) == "":
        raise InputError(
            f"weights_path is required: pass the local path of the {what} weights file (mmspec "
            "never downloads "
            f"weights), got {weights_path!r}."
        )
    path = Path(weights_path).expanduser().resolve()
    if not path.is_file():
        raise InputError(
            f"weights_path {str(path)!r} {why_not_a_file(path)}; pass the local path of the {what} weights file."
        )
    return path


class _TensorImages(Dataset):
    """uint8 [3, H, W] items from an [N, 3, H, W] tensor."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = (
            images if images.dtype == torch.uint8 else (images.clamp(0, 1) * 255).round().to(torch.uint8)
        )

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.images[i].cpu()


class _FolderImages(Dataset):
    """uint8 [3, H, W] items from the image files of a folder (sorted by name, RGB)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        with Image.open(self.files[i]) as img:
            arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)


def _image_dataset(name: str, images) -> Dataset:
    if isinstance(images, (str, os.PathLike)):
        folder = Path(images)
        check(
            folder.is_dir(),
            f"{name} {str(folder)!r} is not a folder; pass a folder of PNG/JPEG files or a tensor.",
        )
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        check(
            len(files) >= 2,
            f"{name} {str(folder)!r} holds {len(files)} PNG/JPEG file(s); at least 2 are needed.",
        )
        return _FolderImages(files)
    return _TensorImages(check_images(name, images, min_count=2))


def _load_plain_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict of tensors from safetensors or a weights-only torch file (no arbitrary code)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the file is not a plain state dict
        raise CheckpointError(f"{path} is not a weights-only torch file or safetensors file: {err}") from err
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise CheckpointError(f"{path} does not hold a state dict (a mapping of names to tensors).")
    return state


# --------------------------------------------------------------------------------------------- Inception FID
def inception_fid(
    generated: torch.Tensor | str | os.PathLike,
    reference: torch.Tensor | str | os.PathLike,
    weights_path: str | os.PathLike,
    *,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> FIDResult:
    """FID between `generated` and `reference` in torch-fidelity's Inception-v3 (2048-d pool features).

    Each side is an image tensor [N, 3, H, W] (uint8 or [0, 1] float) or a folder of PNG/JPEG files of one
    size. `weights_path` is the local Inception weights file; nothing is downloaded.
    """
    path = check_weights_path(weights_path, "torch-fidelity Inception-v3 (inception-v3-compat)")
    check_positive_int("batch_size", batch_size)
    device = torch.device(device)
    ds_gen = _image_dataset("generated", generated)
    ds_ref = _image_dataset("reference", reference)
    state = _load_plain_state_dict(path)
    wrong = {
        k: list(state[k].shape) if k in state else None
        for k, v in INCEPTION_KEY_SHAPES.items()
        if k not in state or tuple(state[k].shape) != v
    }
    if wrong:
        raise CheckpointError(
            f"{path} does not match torch-fidelity's Inception-v3 architecture (key: found shape or None if "
            f"missing): {wrong}; pass the inception-v3-compat weights file."
        )
    torch_fidelity = require_module("torch_fidelity", "torch-fidelity")

    with tempfile.TemporaryDirectory(prefix="mmspec-inception-") as tmp:
        plain = Path(tmp) / "inception.pth"
        torch.save(state, plain)  # only tensors: safe for torch-fidelity's own torch.load
        try:
            metrics = torch_fidelity.calculate_metrics(
                input1=ds_gen,
                input2=ds_ref,
                fid=True,
                feature_extractor="inception-v3-compat",
                feature_extractor_weights_path=str(plain),
                cuda=device.type == "cuda",
                batch_size=batch_size,
                verbose=False,
                cache=False,
                save_cpu_ram=True,
                datasets_download=False,
            )
        except RuntimeError as err:
            if "state_dict" in str(err):
                raise CheckpointError(
                    f"{path} does not match torch-fidelity's Inception-v3 architecture: {err}"
                ) from err
            raise
    return FIDResult(
        fid=max(0.0, float(metrics["frechet_inception_distance"])),
        n_generated=len(ds_gen),
        n_reference=len(ds_ref),
    )


# --------------------------------------------------------------------------------------------- CLIP score
@dataclass(frozen=True)
class ClipScoreResult:
    """Mean CLIP score over `n` (image, text) pairs; `float(result)` gives the score."""

    score: float
    n: int

    def __float__(self) -> float:
        return self.score


def _check_clip_model(model_name: str) -> None:
    open_clip = require_module("open_clip", "open-clip-torch")

    check(
        isinstance(model_name, str) and model_name != "",
        f"model_name must be a non-empty string, got {model_name!r}.",
    )
    check(
        ":" not in model_name,
        f"model_name {model_name!r} uses a schema (hf-hub:/local-dir:); pass a local open_clip "
        "config name (see "
        "open_clip.list_models(), or register one with open_clip.add_model_config) and the "
        "weights via weights_path.",
    )
    config = open_clip.get_model_config(model_name)
    if config is None:
        raise InputError(
            f"model_name {model_name!r} is not an open_clip config known here; pick one of "
            "open_clip.list_models() "
            "or register yours with open_clip.add_model_config(path_to_json)."
        )
    text_cfg = config.get("text_cfg", {})
    if "hf_model_name" in text_cfg or "hf_tokenizer_name" in text_cfg or "siglip" in model_name.lower():
        raise InputError(
            f"model_name {model_name!r} needs a Hugging Face tokenizer or text tower, which "
            "open_clip would download; "
            "mmspec never downloads: use a CLIP config whose tokenizer ships with open_clip (e.g. ViT-B-32)."
        )


def _clip_pixels(images: torch.Tensor, preprocess_cfg: dict) -> torch.Tensor:
    """[N, 3, H, W] -> float [N, 3, S, S] resized (bicubic, antialiased) and normalised for the CLIP tower."""
    import torch.nn.functional as F

    size = preprocess_cfg.get("size", 224)
    size = (size, size) if isinstance(size, int) else tuple(size)
    x = images.to(torch.float32) / 255.0 if images.dtype == torch.uint8 else images.to(torch.float32)
    if tuple(x.shape[-2:]) != size:
        x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    mean = torch.tensor(preprocess_cfg.get("mean", (0.48145466, 0.4578275, 0.40821073))).view(1, 3, 1, 1)
    std = torch.tensor(preprocess_cfg.get("std", (0.26862954, 0.26130258, 0.27577711))).view(1, 3, 1, 1)
    return (x - mean) / std


@torch.no_grad()
def clip_score(
    images: torch.Tensor,
    texts: list[str],
    model_name: str,
    weights_path: str | os.PathLike,
    *,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> ClipScoreResult:
    """Mean CLIPScore, max(100 * cos(image_i, text_i), 0), of N (image, text) pairs with local
    open_clip weights."""
    open_clip = require_module("open_clip", "open-clip-torch")

    images = check_images("images", images)
    check(
        isinstance(texts, (list, tuple)) and all(isinstance(t, str) for t in texts),
        f"texts must be a list of strings, got {type(texts).__name__}.",
    )
    check(
        len(texts) == images.shape[0],
        f"texts has {len(texts)} entries but images has {images.shape[0]}; pass one text per image.",
    )
    check_positive_int("batch_size", batch_size)
    _check_clip_model(model_name)
    path = check_weights_path(weights_path, f"open_clip {model_name}")
    device = torch.device(device)
    try:
        model = open_clip.create_model(
            model_name,
            pretrained=str(path),
            device=device,
            pretrained_image=False,
            pretrained_text=False,
            weights_only=True,
        )
    except RuntimeError as err:
        raise CheckpointError(f"{path} could not be loaded into open_clip {model_name!r}: {err}") from err
    model.eval()
    tokenizer = open_clip.get_tokenizer(model_name)
    preprocess_cfg = open_clip.get_model_preprocess_cfg(model)
    scores = []
    for s in range(0, images.shape[0], batch_size):
        pixels = _clip_pixels(images[s : s + batch_size].cpu(), preprocess_cfg).to(device)
        tokens = tokenizer(list(texts[s : s + batch_size])).to(device)
        img = torch.nn.functional.normalize(model.encode_image(pixels).float(), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(tokens).float(), dim=-1)
        scores.append((100 * (img * txt).sum(-1)).clamp(min=0).cpu())
    all_scores = torch.cat(scores)
    return ClipScoreResult(score=float(all_scores.mean()), n=int(all_scores.shape[0]))
