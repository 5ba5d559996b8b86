"""The embedded world's vocabulary, scene sampling and rasteriser.

A scene is one or two flat-coloured shapes on a background with a gentle brightness gradient. Everything that
decides a scene is an integer drawn from a counter-based hash (splitmix64 over numpy `uint64`) of
`(seed, split, index, attempt, field)`, and every pixel is computed with integer arithmetic, so the same
arguments give byte-identical images on any machine, and any sample can be produced on its own (random access,
which `WorldDataset` relies on) or inside a vectorised batch with the same result.

Geometry is in integer *units* of 1/8 pixel of a 32x32 image; a 64x64 image doubles every coordinate, so the
same (seed, split, index) is the same picture at both sizes, only finer. The rasteriser supersamples every
pixel 4x4 (a subpixel centre sits at an odd unit); coverage (0..16 covered subpixels) blends the shape colour
over the background with integer rounding, which gives light anti-aliasing without any float.

Classes are (shape, colour) pairs: `NUM_CLASSES = 16`, `class_index = shape * 4 + colour`. Size, position,
colour jitter and background never change the class. Two-object scenes use small and medium shapes in cells
two apart (e.g. upper left and right), so the objects never overlap.

Splits are disjoint by construction: a scene's full parameter tuple (seed- and size-independent) hashes with a
fixed salt into one of ten buckets; train owns buckets 0-7, val 8 and test 9, and a sampler redraws until the
scene falls in its split's buckets. So no train scene, for any seed, equals a val or test scene.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# --------------------------------------------------------------------------------------------- vocabulary
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
COLOR_RGB: tuple[tuple[int, int, int], ...] = ((220, 40, 40), (40, 170, 60), (40, 90, 230), (240, 210, 40))
SIZES: tuple[str, ...] = ("small", "medium", "large")
# half-extent of a shape in units of a 32x32 image (1/8 px; the side is 256 units): ~13%, 20%, 28% of the side
SIZE_HALF_UNITS: tuple[int, ...] = (33, 50, 72)
SIZE_JITTER = 4  # +- units on the half-extent
POSITION_JITTER = 6  # +- units on each centre coordinate
BACKGROUNDS: tuple[str, ...] = ("black", "dark gray", "light gray", "white", "brown", "purple")
BACKGROUND_RGB: tuple[tuple[int, int, int], ...] = (
    (16, 16, 16),
    (72, 72, 72),
    (176, 176, 176),
    (236, 236, 236),
    (112, 72, 40),
    (88, 48, 112),
)
# 3x3 grid cells, index = row * 3 + col; short names (answers) and the phrase used in sentences
POSITIONS: tuple[str, ...] = (
    "upper left",
    "top",
    "upper right",
    "left",
    "center",
    "right",
    "lower left",
    "bottom",
    "lower right",
)
POSITION_PHRASES: tuple[str, ...] = (
    "in the upper left",
    "at the top",
    "in the upper right",
    "on the left",
    "in the center",
    "on the right",
    "in the lower left",
    "at the bottom",
    "in the lower right",
)
COLOR_JITTER = 16  # per channel, +-
GRADIENT_MAX = 24  # brightness change from the centre to an edge, at most
SUPERSAMPLE = 4  # subpixels per pixel side
UNITS_PER_PIXEL = 2 * SUPERSAMPLE  # geometry unit: 1/8 pixel, subpixel centres at odd units
SPLITS: dict[str, tuple[int, ...]] = {"train": tuple(range(8)), "val": (8,), "test": (9,)}
IMAGE_SIZES: tuple[int, ...] = (32, 64)  # multiples of 32: a scene's geometry scales exactly with the size
BASE_SIZE = 32

NUM_SHAPES = len(SHAPES)
NUM_COLORS = len(COLORS)
NUM_CLASSES = NUM_SHAPES * NUM_COLORS
CLASS_NAMES: tuple[str, ...] = tuple(f"{c} {s}" for s in SHAPES for c in COLORS)

# ordered cell pairs (first, second) for two-object scenes: Chebyshev distance 2 keeps the objects apart
CELL_PAIRS: tuple[tuple[int, int], ...] = tuple(
    (a, b) for a in range(9) for b in range(9) if max(abs(a % 3 - b % 3), abs(a // 3 - b // 3)) == 2
)


def class_index(shape: int, color: int) -> int:
    """Class of a (shape, colour) pair: `shape * NUM_COLORS + color`."""
    return shape * NUM_COLORS + color


def class_name(index: int) -> str:
    """Human name of class `index`, e.g. `class_name(0) == "red circle"`."""
    from mmspec.errors import InputError

    if (
        isinstance(index, bool)
        or not isinstance(index, (int, np.integer))
        or not 0 <= int(index) < NUM_CLASSES
    ):
        raise InputError(f"index must be an integer class in [0, {NUM_CLASSES}), got {index!r}.")
    return CLASS_NAMES[int(index)]


def class_parts(index: int) -> tuple[str, str]:
    """(colour, shape) names of class `index`."""
    name = class_name(index)
    color, shape = name.split(" ")
    return color, shape


# --------------------------------------------------------------------------------------------- hashing
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_SPLIT_SALT = np.uint64(0x5EED5EED12345678)  # fixed: split membership does not depend on the seed


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MUL1
        x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def _u64(values) -> np.ndarray:
    return np.asarray(values).astype(np.uint64)


def stream_key(seed: int, split: str) -> np.uint64:
    """The 64-bit key of a (seed, split) stream."""
    split_code = _u64([list(SPLITS).index(split) + 1])
    return _mix(_mix(_u64([seed])) ^ _mix(split_code * _GOLDEN))[0]


class _Draw:
    """Uniform draws for one attempt: `draw.int(field, n)` gives ints in [0, n) for every row."""

    def __init__(self, key: np.uint64, index: np.ndarray, attempt: np.ndarray) -> None:
        base = _mix(_u64(index) ^ key)
        self._base = _mix(base ^ _mix(_u64(attempt) * _MUL1))

    def bits(self, field: int) -> np.ndarray:
        return _mix(self._base ^ _mix(_u64([field + 1]) * _MUL2))

    def int(self, field: int, n: int) -> np.ndarray:
        return (self.bits(field) % np.uint64(n)).astype(np.int64)

    def uniform(self, field: int) -> np.ndarray:
        """float64 in [0, 1) with 53 random bits (exact, platform-independent)."""
        return (self.bits(field) >> np.uint64(11)).astype(np.float64) / float(2**53)


# --------------------------------------------------------------------------------------------- scenes
@dataclass
class SceneParams:
    """Integer parameters of N scenes; object axis has length 2 (second object -1 / 0 when absent).

    Geometry (`cx`, `cy`, `half`) is in units of 1/8 pixel of a 32x32 image; an image of size S multiplies it
    by S // 32, so a scene is the same picture at every size (only finer).
    """

    image_size: int
    n_objects: np.ndarray  # [N] 1 or 2
    shape: np.ndarray  # [N, 2] shape index, -1 when absent
    color: np.ndarray  # [N, 2] colour index, -1 when absent
    size: np.ndarray  # [N, 2] size class, -1 when absent
    cell: np.ndarray  # [N, 2] grid cell 0..8 (row * 3 + col), -1 when absent
    half: np.ndarray  # [N, 2] half-extent in units
    cx: np.ndarray  # [N, 2] centre x in units
    cy: np.ndarray  # [N, 2] centre y in units
    rgb: np.ndarray  # [N, 2, 3] object colour after jitter
    background: np.ndarray  # [N] background index
    grad: np.ndarray  # [N, 3] (gx, gy, amplitude): gx, gy in {-1, 0, 1}, amplitude 0..GRADIENT_MAX

    def __len__(self) -> int:
        return int(self.n_objects.shape[0])

    @property
    def label(self) -> np.ndarray:
        """[N] class of the first object."""
        return self.shape[:, 0] * NUM_COLORS + self.color[:, 0]

    def take(self, rows: np.ndarray) -> SceneParams:
        """The scenes at `rows`."""
        fields = {k: v[rows] if isinstance(v, np.ndarray) else v for k, v in self.__dict__.items()}
        return SceneParams(**fields)


def _place(draw: _Draw, field: int, size: np.ndarray, cell: np.ndarray):
    """Half-extent and centre (units of a 32x32 image) of objects with the given size class and cell."""
    span = BASE_SIZE * UNITS_PER_PIXEL
    base = np.asarray(SIZE_HALF_UNITS, dtype=np.int64)[size]
    half = base + draw.int(field, 2 * SIZE_JITTER + 1) - SIZE_JITTER
    margin = half + 2 * POSITION_JITTER  # keeps a jittered shape >= 0.75 px inside the image
    step = (span - 2 * margin) // 2
    col, row = cell % 3, cell // 3
    cx = margin + col * step + draw.int(field + 1, 2 * POSITION_JITTER + 1) - POSITION_JITTER
    cy = margin + row * step + draw.int(field + 2, 2 * POSITION_JITTER + 1) - POSITION_JITTER
    return half, cx, cy


def _draw_scenes(draw: _Draw, n: int, image_size: int, two_objects: float) -> SceneParams:
    """One attempt at N scenes (every row drawn; rejection by split happens outside)."""
    two = draw.uniform(0) < two_objects  # [N]
    shape = np.stack([draw.int(1, NUM_SHAPES), draw.int(2, NUM_SHAPES)], axis=1)
    color = np.stack([draw.int(3, NUM_COLORS), draw.int(4, NUM_COLORS)], axis=1)
    size_one = draw.int(5, len(SIZES))
    size_two = np.stack([draw.int(6, 2), draw.int(7, 2)], axis=1)  # small or medium only
    cell_one = draw.int(8, 9)
    pair = np.asarray(CELL_PAIRS, dtype=np.int64)[draw.int(9, len(CELL_PAIRS))]  # [N, 2]
    size = np.where(two[:, None], size_two, np.stack([size_one, np.full(n, -1)], axis=1))
    cell = np.where(two[:, None], pair, np.stack([cell_one, np.full(n, -1)], axis=1))
    shape[:, 1] = np.where(two, shape[:, 1], -1)
    color[:, 1] = np.where(two, color[:, 1], -1)
    half0, cx0, cy0 = _place(draw, 10, size[:, 0], cell[:, 0])
    half1, cx1, cy1 = _place(draw, 13, np.maximum(size[:, 1], 0), np.maximum(cell[:, 1], 0))
    present = two.astype(np.int64)
    half = np.stack([half0, half1 * present], axis=1)
    cx = np.stack([cx0, cx1 * present], axis=1)
    cy = np.stack([cy0, cy1 * present], axis=1)
    base_rgb = np.asarray(COLOR_RGB, dtype=np.int64)[np.maximum(color, 0)]  # [N, 2, 3]
    jit = np.stack([draw.int(20 + k, 2 * COLOR_JITTER + 1) for k in range(6)], axis=1).reshape(n, 2, 3)
    rgb = (
        np.clip(base_rgb + jit - COLOR_JITTER, 0, 255)
        * np.stack([np.ones(n, np.int64), present], 1)[..., None]
    )
    background = draw.int(30, len(BACKGROUNDS))
    grad = np.stack([draw.int(31, 3) - 1, draw.int(32, 3) - 1, draw.int(33, GRADIENT_MAX + 1)], axis=1)
    flat = (grad[:, 2] == 0) | ((grad[:, 0] == 0) & (grad[:, 1] == 0))
    grad[flat] = 0  # one canonical form for a flat background, so equal pictures have equal parameters
    return SceneParams(
        image_size=image_size,
        n_objects=1 + present,
        shape=shape,
        color=color,
        size=size,
        cell=cell,
        half=half,
        cx=cx,
        cy=cy,
        rgb=rgb,
        background=background,
        grad=grad,
    )


def _scene_bucket(p: SceneParams) -> np.ndarray:
    """[N] bucket 0..9 from a hash of every parameter of the scene (seed- and size-independent)."""
    h = np.full(len(p), _SPLIT_SALT, dtype=np.uint64)
    fields = [
        p.n_objects[:, None], p.shape, p.color, p.size, p.cell, p.half, p.cx, p.cy,
        p.rgb.reshape(len(p), -1), p.background[:, None], p.grad,
    ]  # fmt: skip
    for f in fields:
        for col in np.asarray(f).reshape(len(p), -1).T:
            h = _mix(h ^ _u64(col + (1 << 20)))  # offset keeps -1 distinct and positive
    return (h % np.uint64(10)).astype(np.int64)


def sample_scenes(
    indices: np.ndarray, seed: int, split: str, image_size: int = 32, two_objects: float = 0.0
) -> SceneParams:
    """Scene parameters of samples `indices` of the (seed, split) stream; rows are independent."""
    indices = np.asarray(indices, dtype=np.int64)
    n = indices.shape[0]
    key = stream_key(seed, split)
    allowed = np.asarray(SPLITS[split])
    out: SceneParams | None = None
    todo = np.arange(n)
    attempt = 0
    while todo.size:
        draw = _Draw(key, indices[todo], np.full(todo.size, attempt))
        params = _draw_scenes(draw, todo.size, image_size, two_objects)
        ok = np.isin(_scene_bucket(params), allowed)
        if out is None:  # the first attempt covers every row; later attempts fill in the rejected ones
            out = params
        else:
            for name, value in params.__dict__.items():
                if isinstance(value, np.ndarray):
                    getattr(out, name)[todo[ok]] = value[ok]
        todo = todo[~ok]
        attempt += 1
    assert out is not None
    return out


# --------------------------------------------------------------------------------------------- rendering
def _background(p: SceneParams) -> np.ndarray:
    """[N, 3, S, S] int32 background with a linear brightness gradient."""
    s = p.image_size
    base = np.asarray(BACKGROUND_RGB, dtype=np.int32)[p.background]  # [N, 3]
    coord = 2 * np.arange(s, dtype=np.int32) + 1 - s  # [S], odd, symmetric around 0
    gx, gy, amp = (p.grad[:, k].astype(np.int32) for k in range(3))
    ramp = gx[:, None, None] * coord[None, None, :] + gy[:, None, None] * coord[None, :, None]  # [N, S, S]
    offset = amp[:, None, None] * ramp // (2 * s)
    return np.clip(base[:, :, None, None] + offset[:, None], 0, 255)


def _shape_mask(kind: int, dx: np.ndarray, dy: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Subpixel mask of shape `kind` given offsets from the centre and half-extent (all in units)."""
    adx, ady = np.abs(dx), np.abs(dy)
    if kind == 0:  # circle
        return dx * dx + dy * dy <= h * h
    if kind == 1:  # square, a little smaller than the circle's box so the two have similar area
        side = h * 17 // 20
        return (adx <= side) & (ady <= side)
    if kind == 2:  # triangle: apex up at cy - h, flat base at cy + h, half-base h
        return (2 * adx <= dy + h) & (dy <= h)
    arm = h * 9 // 25  # cross (plus sign): two bars of half-length h and half-width `arm`
    return ((adx <= arm) & (ady <= h)) | ((ady <= arm) & (adx <= h))


def _pool_count(mask: np.ndarray, s: int) -> np.ndarray:
    """[n, S*ss, S*ss] bool -> [n, S, S] count of True per ss x ss block (static adds beat a strided sum)."""
    ss = SUPERSAMPLE
    u = mask.view(np.uint8).reshape(mask.shape[0], s, ss, s, ss)
    rows = u[:, :, 0].copy()
    for k in range(1, ss):
        rows += u[:, :, k]  # [n, S, S, ss]
    out = rows[..., 0].astype(np.int32)
    for k in range(1, ss):
        out += rows[..., k]
    return out


def _coverage(p: SceneParams, obj: int) -> np.ndarray:
    """[N, S, S] int32 number of covered subpixels (0..SUPERSAMPLE**2) of object `obj` in every scene."""
    s, ss, n = p.image_size, SUPERSAMPLE, len(p)
    u = 2 * np.arange(s * ss, dtype=np.int32) + 1  # subpixel centres in units
    cov = np.zeros((n, s, s), dtype=np.int32)
    for kind in range(NUM_SHAPES):  # static loop over shape kinds, vectorised over the rows of that kind
        rows = np.flatnonzero(p.shape[:, obj] == kind)
        if rows.size == 0:
            continue
        f = s // BASE_SIZE  # geometry is stored for a 32x32 image
        dx = u[None, None, :] - f * p.cx[rows, obj, None, None].astype(np.int32)  # [n, 1, W]
        dy = u[None, :, None] - f * p.cy[rows, obj, None, None].astype(np.int32)  # [n, H, 1]
        mask = _shape_mask(kind, dx, dy, f * p.half[rows, obj, None, None].astype(np.int32))  # [n, H, W]
        cov[rows] = _pool_count(mask, s)
    return cov


def render(p: SceneParams) -> np.ndarray:
    """[N, 3, S, S] uint8 images of the scenes (integer arithmetic only)."""
    n, s = len(p), p.image_size
    chunk = max(1, 256 * 32 * 32 // (s * s))  # bounds the [chunk, 4S, 4S] subpixel masks' memory
    out = np.empty((n, 3, s, s), dtype=np.uint8)
    full = SUPERSAMPLE * SUPERSAMPLE
    for start in range(0, n, chunk):
        rows = np.arange(start, min(n, start + chunk))
        part = p.take(rows)
        img = _background(part)  # [n, 3, S, S] int32
        for obj in range(2):
            cov = _coverage(part, obj)[:, None]  # [n, 1, S, S]
            fg = part.rgb[:, obj, :, None, None].astype(np.int32)  # [n, 3, 1, 1]
            img = (img * (full - cov) + fg * cov + full // 2) // full  # cov 0 leaves a pixel unchanged
        out[rows] = img.astype(np.uint8)
    return out
