"""The limits every front end checks the same way: `mmspec generate` and `mmspec vlm` (command line and job files)
and the demo apps. Each check is one line that names the setting, before any model loads or any folder is made.

    check_seed("--seed", args.seed)
    check_count("--num-images", args.num_images)
    check_sampling(guidance_scale=4.0, temperature=1.0, top_k=0, top_p=1.0)   # None = the family's default
"""

from __future__ import annotations

from mmspec.errors import check

MAX_IMAGES_PER_ROW = 100_000  # images of one class, caption or job row (a bigger run is a job of several rows)
SEED_LIMIT = 2**53  # seeds in [0, 2^53): exact as a JSON number and in a browser's number field
SAMPLING_LIMITS = {"guidance_scale": (0.0, 50.0), "temperature": (0.0, 10.0), "top_p": (0.0, 1.0)}


def is_integer(value) -> bool:
    """An int, or a float with no fraction (a browser's number field sends floats); never a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()


def check_seed(name: str, value) -> int:
    """InputError unless `value` is a whole number in [0, SEED_LIMIT); returns it as an int."""
    check(is_integer(value) and 0 <= value < SEED_LIMIT,
          f"{name} must be a whole number in [0, 2^53), got {value!r}.")
    return int(value)


def check_count(name: str, value, limit: int = MAX_IMAGES_PER_ROW,
                hint: str = "; split a bigger run into job rows") -> int:
    """InputError unless `value` is a whole number in [1, limit]; returns it as an int."""
    check(is_integer(value) and 1 <= value <= limit, f"{name} must be a whole number from 1 to {limit}, "
                                                     f"got {value!r}{hint}.")
    return int(value)


def check_sampling(guidance_scale=None, temperature=None, top_k=None, top_p=None) -> None:
    """InputError naming the first setting out of its range (`SAMPLING_LIMITS`; top-k a whole number >= 0, top-p
    > 0); None means the family's default and is not checked."""
    for name, value in (("guidance_scale", guidance_scale), ("temperature", temperature), ("top_p", top_p)):
        low, high = SAMPLING_LIMITS[name]
        check(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                and low <= value <= high),
              f"{name.replace('_', ' ')} must be between {low:g} and {high:g}, got {value!r}.")
    check(top_k is None or (is_integer(top_k) and top_k >= 0), f"top-k must be a whole number >= 0 (0 = off), "
                                                               f"got {top_k!r}.")
    check(top_p is None or top_p > 0, f"top-p must be > 0 (1 = off), got {top_p!r}.")
