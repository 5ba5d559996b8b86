"""Training-loss pieces for `LlamaGenVQ`: reconstruction (L2, L1), an image-gradient (edge) loss, and the
quantizer's codebook / commitment / entropy terms, combined by `vq_loss`.

The official objective (LlamaGen `tokenizer/tokenizer_image/vq_loss.py`) is
`rec_weight * L2 + perceptual_weight * LPIPS + adversarial + (vq_loss + commit_loss + entropy_loss)`. LPIPS needs
downloaded VGG weights and the adversarial term a discriminator, so neither is here; instead an optional L1 term
and an L1 loss on finite differences (edges) stand in for the perceptual term. With the default weights
(`l2=1`, everything else at its official value or off) this is the official objective without LPIPS and GAN.
The training command (written elsewhere) runs the model in train mode and calls::

    out = vq(images)                                  # LlamaGenVQOutput(sample, latents, ids, losses)
    loss, logs = vq_loss(out, images, VQLossWeights(l1=0.1, gradient=0.1))
    loss.backward()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from image_ar.llamagen.vq import LlamaGenVQOutput, VQLosses
from mmspec.errors import InputError, check, check_nonnegative
from mmspec.world_training import gradient_loss

__all__ = ["VQLossWeights", "gradient_loss", "vq_loss"]


@dataclass(frozen=True)
class VQLossWeights:
    """Weights of the terms of `vq_loss` (all >= 0; 0 skips a term).

    l2: mean squared error (official reconstruction loss, weight 1). l1: mean absolute error. gradient: L1
    between the horizontal and vertical finite differences of reconstruction and target (edges). quantizer:
    multiplies codebook + commitment + entropy losses, which already carry commit_loss_beta and
    entropy_loss_ratio from the model config (official: 1).
    """

    l2: float = 1.0
    l1: float = 0.0
    gradient: float = 0.0
    quantizer: float = 1.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool),
                  f"VQLossWeights.{field.name} must be a number, got {value!r}.")
            check_nonnegative(f"VQLossWeights.{field.name}", value)


def vq_loss(
    model_out: LlamaGenVQOutput | tuple[torch.Tensor, VQLosses],
    images: torch.Tensor,
    weights: VQLossWeights | Mapping[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The tokenizer's training loss and its parts.

    model_out: `LlamaGenVQ.forward(images)` output (or its `return_dict=False` tuple `(sample, losses)`);
    images: the [B, C, H, W] targets in [-1, 1]; weights: `VQLossWeights` or a dict of its fields.
    Returns `(loss [], logs)`: logs maps 'loss', 'l2', 'l1', 'gradient', 'codebook_loss', 'commit_loss',
    'entropy_loss' to detached unweighted 0-dim tensors (no host sync), plus 'codebook_usage' when the model
    reported it (train mode with codebook_show_usage).
    """
    w = _weights(weights)
    if isinstance(model_out, LlamaGenVQOutput):
        recon, losses = model_out.sample, model_out.losses
    elif isinstance(model_out, tuple) and len(model_out) == 2:
        recon, losses = model_out
    else:
        raise InputError(
            f"model_out must be the LlamaGenVQ forward output (LlamaGenVQOutput or (sample, losses)), got "
            f"{type(model_out).__name__}."
        )
    check(isinstance(losses, VQLosses),
          "model_out carries no quantizer losses; pass the output of LlamaGenVQ.forward, not decode().")
    check(isinstance(images, torch.Tensor) and images.shape == recon.shape,
          f"images must have the reconstruction's shape {list(recon.shape)}, got "
          f"{list(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}.")
    target = images.to(recon.dtype)
    terms = {
        "l2": F.mse_loss(recon, target),
        "l1": F.l1_loss(recon, target) if w.l1 > 0 else recon.new_zeros(()),
        "gradient": gradient_loss(recon, target) if w.gradient > 0 else recon.new_zeros(()),
    }
    loss = w.l2 * terms["l2"] + w.l1 * terms["l1"] + w.gradient * terms["gradient"] + w.quantizer * losses.total
    logs = {"loss": loss.detach(), **{k: v.detach() for k, v in terms.items()},
            "codebook_loss": losses.codebook_loss.detach(), "commit_loss": losses.commit_loss.detach(),
            "entropy_loss": losses.entropy_loss.detach()}
    if losses.codebook_usage is not None:
        logs["codebook_usage"] = torch.tensor(float(losses.codebook_usage))
    return loss, logs


def _weights(weights: VQLossWeights | Mapping[str, float] | None) -> VQLossWeights:
    if weights is None:
        return VQLossWeights()
    if isinstance(weights, VQLossWeights):
        return weights
    if isinstance(weights, Mapping):
        names = {f.name for f in dataclasses.fields(VQLossWeights)}
        unknown = sorted(set(weights) - names)
        check(not unknown, f"weights has unknown term(s) {unknown}; valid are {sorted(names)}.")
        return VQLossWeights(**weights)
    raise InputError(f"weights must be a VQLossWeights, a dict of its fields or None, got {type(weights).__name__}.")
