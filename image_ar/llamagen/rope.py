"""LlamaGen's 2D rotary position embedding, with the official zero rows at the condition positions.

The table has one row per absolute sequence position: `cls_token_num` condition positions, then the
`grid * grid` image tokens in raster order (image token i = row i // grid, column i % grid sits at position
`cls_token_num + i`). Each row holds (cos, sin) for the `head_dim // 2` rotation pairs:

- the angle frequencies are `1 / base ** (arange(0, half, 2)[: half // 2] / half)` with `half = head_dim // 2`
  (note the exponent is divided by half the head dim, not by the head dim);
- pairs `0 .. head_dim // 4 - 1` rotate by `row * freq`, pairs `head_dim // 4 .. head_dim // 2 - 1` by
  `column * freq` (row frequencies first, then column frequencies, concatenated);
- pair j rotates the INTERLEAVED channels (2j, 2j + 1) of each head (the gpt-fast / Llama layout, not the
  rotate-half layout);
- the condition rows are (cos, sin) = (0, 0), which multiplies q and k by zero there: condition keys score 0
  against every query and condition queries attend uniformly. This is the official behaviour (checkpoints were
  trained with it), reproduced on purpose.

Everything is computed in float32 and cast back to the input dtype, as the official code does.

The models rotate through `rotate` with rows of `rotation_table` (per channel: the cosine of its pair, and the
sine signed as the rotation uses it, -sin on even channels and +sin on odd): a pair swap, two products and a sum,
four operations where the official formula takes seven, with the same numbers bit for bit (x_even * cos +
x_odd * (-sin) is x_even * cos - x_odd * sin in IEEE arithmetic). The models rotate q and k in one call.
"""

from __future__ import annotations

import functools
import math

import torch

from mmspec.errors import InputError


def grid_size_of(block_size: int) -> int:
    """The side of the square token grid: sqrt(block_size); InputError if block_size is not a square."""
    grid = math.isqrt(block_size) if isinstance(block_size, int) and block_size > 0 else 0
    if grid * grid != block_size or grid == 0:
        raise InputError(
            f"block_size must be a positive perfect square (the number of image tokens of a square grid, e.g. "
            f"256 = 16 x 16), got {block_size!r}."
        )
    return grid


def rope_table_2d(grid_size: int, head_dim: int, base: float = 10000.0, cls_token_num: int = 1) -> torch.Tensor:
    """The (cos, sin) table [cls_token_num + grid_size**2, head_dim // 2, 2] in float32 on the CPU."""
    if head_dim % 4 != 0 or head_dim <= 0:
        raise InputError(
            f"2D RoPE needs a head dim divisible by 4 (half for rows, half for columns, in pairs), got head_dim="
            f"{head_dim}; choose dim and n_head with dim // n_head a multiple of 4."
        )
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device="cpu")[: half // 2] / half  # [hd/4]
    freqs = 1.0 / (base**exponents)  # [hd/4]
    steps = torch.arange(grid_size, dtype=torch.float32, device="cpu")  # [g]
    angles = torch.outer(steps, freqs)  # [g, hd/4]
    grid_angles = torch.cat(
        [angles[:, None, :].expand(-1, grid_size, -1), angles[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )  # [g, g, hd/2]: row angles, then column angles
    image_rows = torch.stack([grid_angles.cos(), grid_angles.sin()], dim=-1).flatten(0, 1)  # [g*g, hd/2, 2]
    cond_rows = torch.zeros(cls_token_num, half, 2, dtype=torch.float32, device="cpu")  # [C, hd/2, 2]
    return torch.cat([cond_rows, image_rows], dim=0)  # [C + g*g, hd/2, 2]


def lookup_rope(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of `table` [P, ...] at positions [B, S] (or [S]) -> [B, S, ...] (or [S, ...])."""
    return table[positions]


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by rope [B|1, S, D/2, 2] (or [S, D/2, 2]) rows of `rope_table_2d`; float32 math,
    result in x's dtype."""
    return rotate(x, rotation_table(rope))


def rotation_table(rope: torch.Tensor) -> torch.Tensor:
    """(cos, sin) rows [..., D/2, 2] -> rotation rows [..., 2, D]: per channel the cosine of its pair, and the sine
    as the rotation uses it (-sin on the pair's even channel, +sin on its odd one)."""
    cos, sin = rope[..., 0], rope[..., 1]  # [..., D/2]
    return torch.stack([torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)], -2)


def pair_swap_index(dim: int, device: torch.device) -> torch.Tensor:
    """[D] channel order with each pair (2j, 2j + 1) swapped: a gather by it is the pair swap of `rotate` (one
    `index_select`; a `flip` of the pairs' last axis cost 2-3x as much on a CPU). Made once per (dim, device)
    eagerly; inside torch.compile in the graph (a constant there; dynamo warns about traced cached functions)."""
    if torch.compiler.is_compiling():
        return swap_order(dim, device)
    return cached_swap_order(dim, device)


def swap_order(dim: int, device: torch.device) -> torch.Tensor:
    return torch.arange(dim, device=device).view(-1, 2).flip(-1).flatten()  # [D]


cached_swap_order = functools.cache(swap_order)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by rotation rows [B|1, S, 2, D] (or [S, 2, D]) of `rotation_table`: channel 2j becomes
    x_2j cos - x_2j+1 sin, channel 2j+1 x_2j+1 cos + x_2j sin; float32 math, result in x's dtype."""
    if rotation.dim() == 3:
        rotation = rotation.unsqueeze(0)  # [1, S, 2, D]
    xf = x.float()  # [B, S, H, D]
    swapped = xf.index_select(-1, pair_swap_index(xf.shape[-1], xf.device))  # [B, S, H, D] each pair swapped
    cos, sin = rotation[:, :, 0].unsqueeze(2), rotation[:, :, 1].unsqueeze(2)  # [B, S, 1, D] each
    return (xf * cos + swapped * sin).to(x.dtype)


class RopePositions:
    """Mixin for LlamaGen-layout models (the GPT and its EAGLE drafter): a `_rope` table from `rope_table_2d` over
    `cls_token_num + block_size` absolute positions; `rope_rows` reads its `rotation_table` (made once, on the
    device of the positions it is read at)."""

    cls_token_num: int
    block_size: int
    _rope: torch.Tensor
    _rotation: torch.Tensor | None = None  # rotation_table(_rope), on the device last read

    @property
    def max_seq_len(self) -> int:
        """Number of absolute positions with a rotary row: cls_token_num + block_size."""
        return self.cls_token_num + self.block_size

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotation rows [*positions.shape, 2, head_dim] float32 (`rotation_table`) for absolute positions."""
        if self._rotation is None or self._rotation.device != positions.device:
            self._rope = self._rope.to(positions.device)
            self._rotation = rotation_table(self._rope)  # [P, 2, hd]
        return lookup_rope(self._rotation, positions)
