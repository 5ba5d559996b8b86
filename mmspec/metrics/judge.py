"""The world judge: a tiny CNN that classifies world images and gives the feature space of world-FID.

Input: images [N, 3, H, W], uint8 (0..255) or float in [0, 1]. Other sizes than the judge's `image_size` (32)
are resized first (area averaging when shrinking by an integer factor, antialiased bilinear otherwise).

Outputs: `forward` gives class logits [N, 16]; `features` gives the penultimate layer [N, feature_dim] (the
FID feature); `heads` gives every head's logits: class, plus the auxiliary heads (size, position cell,
background) that the judge is trained on so that its features also see what the class does not (a generator
that always draws its shapes in the centre is off in feature space even when every class is right).

Stored as `model.safetensors` + `config.json` (architecture, preprocessing and how it was trained).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mmspec.data.artifacts import ASSETS_DIR
from mmspec.data.world import BACKGROUNDS, NUM_CLASSES, POSITIONS, SIZES
from mmspec.errors import CheckpointError, InputError, check

DEFAULT_JUDGE_PATH = ASSETS_DIR / "judge"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass
class JudgeConfig:
    """Architecture of the judge (what `config.json` stores under "architecture")."""

    image_size: int = 32
    channels: tuple[int, ...] = (16, 32, 48, 48)
    feature_dim: int = 64
    num_classes: int = NUM_CLASSES
    aux_heads: dict[str, int] = field(
        default_factory=lambda: {
            "size": len(SIZES),
            "position": len(POSITIONS),
            "background": len(BACKGROUNDS),
        }
    )
    mean: float = 0.5
    std: float = 0.25

    @classmethod
    def from_dict(cls, d: dict) -> JudgeConfig:
        d = dict(d)
        d["channels"] = tuple(d["channels"])
        return cls(**d)


def _conv_block(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class WorldJudge(nn.Module):
    """Conv stack (first at full resolution, then stride 2) -> flatten -> linear features -> heads."""

    def __init__(self, config: JudgeConfig | None = None) -> None:
        super().__init__()
        self.config = config or JudgeConfig()
        c = self.config.channels
        blocks = [_conv_block(3, c[0], 1)] + [_conv_block(c[i - 1], c[i], 2) for i in range(1, len(c))]
        self.body = nn.Sequential(*blocks)
        side = self.config.image_size // 2 ** (len(c) - 1)
        self.embed = nn.Linear(c[-1] * side * side, self.config.feature_dim)
        self.classifier = nn.Linear(self.config.feature_dim, self.config.num_classes)
        self.aux = nn.ModuleDict(
            {k: nn.Linear(self.config.feature_dim, n) for k, n in self.config.aux_heads.items()}
        )

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 or [0, 1] float images at any size -> normalised float at the judge's resolution."""
        x = images.to(torch.float32) / 255.0 if images.dtype == torch.uint8 else images.to(torch.float32)
        size = self.config.image_size
        h, w = x.shape[-2:]
        if (h, w) != (size, size):
            if h % size == 0 and w % size == 0:
                x = F.avg_pool2d(x, kernel_size=(h // size, w // size))
            else:
                x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        return (x - self.config.mean) / self.config.std

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """[N, feature_dim] penultimate-layer features (post-ReLU), the space world-FID is computed in."""
        x = self.body(self.preprocess(images))  # [N, C, s, s]
        return F.relu(self.embed(x.flatten(1)))

    def heads(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logits of every head: "class" [N, 16], "size" [N, 3], "position" [N, 9], "background" [N, 6]."""
        f = self.features(images)
        out = {"class": self.classifier(f)}
        out.update({k: head(f) for k, head in self.aux.items()})
        return out

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[N, num_classes] class logits."""
        return self.classifier(self.features(images))

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """[N] int64 predicted class."""
        return self(images).argmax(-1)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------- save / load
def save_judge(model: WorldJudge, out: str | os.PathLike, training: dict | None = None) -> None:
    """Write `model.safetensors` and `config.json` ({"architecture": ..., "training": ...}) into `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "model": "mmspec.metrics.WorldJudge"})
    config = {"model": "WorldJudge", "architecture": asdict(model.config), "training": training or {}}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


_CACHE: dict[tuple[str, str], WorldJudge] = {}


def load_judge(path: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> WorldJudge:
    """The judge in folder `path` (default: the shipped `assets/judge`), in eval mode, gradients off.

    Loads are cached per (folder, device); safetensors only, strict key and shape check.
    """
    from safetensors.torch import load_file

    folder = Path(DEFAULT_JUDGE_PATH if path is None else path).resolve()
    key = (str(folder), str(device))
    if key in _CACHE:
        return _CACHE[key]
    weights, config_file = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not (weights.is_file() and config_file.is_file()):
        raise InputError(
            f"path {str(folder)!r} must hold {WEIGHTS_FILE} and {CONFIG_FILE}; train a judge with "
            f"`mmspec train judge --out {folder}` or pass the folder of an existing one."
        )
    config = JudgeConfig.from_dict(json.loads(config_file.read_text())["architecture"])
    model = WorldJudge(config)
    state = load_file(str(weights))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{weights} does not match the judge architecture in {config_file}: missing keys {missing}, "
            f"unexpected keys {unexpected}, wrong shapes {[(k, list(state[k].shape)) for k in wrong]}."
        )
    model.load_state_dict(state, strict=True)
    model.to(device).eval().requires_grad_(False)
    _CACHE[key] = model
    return model


def resolve_judge(judge: WorldJudge | str | os.PathLike | None) -> WorldJudge:
    """A judge object from None (the shipped one), a folder path, or a `WorldJudge`."""
    if isinstance(judge, WorldJudge):
        return judge
    check(
        judge is None or isinstance(judge, (str, os.PathLike)),
        f"judge must be None (the shipped judge), a folder path or a WorldJudge, got {type(judge).__name__}.",
    )
    return load_judge(judge)
