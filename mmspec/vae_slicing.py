"""diffusers' sliced VAE decoding (`vqvae.enable_slicing()` / `disable_slicing()`, as on `AutoencoderKL`) for
mmspec's own VQ models: with slicing on, the decoder runs on one image at a time, so a large batch decodes in the
memory of one image (the decoder's activations at full resolution are what peaks). Same images either way: each
image's decode does not depend on the others in its batch (tested).

    pipe.vqvae.enable_slicing()
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SlicedDecodeMixin:
    """`enable_slicing` / `disable_slicing` and `decode_slices(fn, x)`, which a model's decode calls (see the module
    docstring)."""

    use_slicing: bool = False

    def enable_slicing(self) -> None:
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    def decode_slices(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn(x) on x [B, ...], one image at a time when slicing is on."""
        if not self.use_slicing or x.shape[0] <= 1:
            return fn(x)
        return torch.cat([fn(row) for row in x.split(1)])
