"""diffusers' model-level attention switch (`model.set_attention_backend(name)`, `reset_attention_backend()`) for
mmspec's own models.

diffusers' `ModelMixin.set_attention_backend` only touches diffusers' attention modules, so on an mmspec model it
would return None and change nothing. Models whose attention runs through `mmspec.attention.attend` take
`AttentionBackendMixin` (listed before `ModelMixin`): the name is one of mmspec's backends (`eager`, `sdpa`,
`xformers`, `triton`, or one registered with `register_backend`) or diffusers' name of the same thing (`native` =
`sdpa`, `_native_math` = `eager`); it is checked for this model's device at once, then stored in the model's
`attention_backend` and in every submodule that has one. Models whose attention is another library's take
`FixedAttentionMixin`, which raises a one-line error saying so.

    pipe.transformer.set_attention_backend("eager")    # float32 softmax, the reference
    pipe.transformer.reset_attention_backend()         # back to attend's default (sdpa)
"""

from __future__ import annotations

from mmspec.attention import check_backend_usable, registered_backends
from mmspec.errors import InputError

DIFFUSERS_NAMES = {"native": "sdpa", "_native_math": "eager"}  # diffusers' backend name -> mmspec's


def mmspec_backend_name(backend: str) -> str:
    """mmspec's name of `backend` (one of its own, or diffusers' name of the same backend); InputError if none."""
    name = DIFFUSERS_NAMES.get(backend, backend) if isinstance(backend, str) else backend
    if name not in registered_backends():
        raise InputError(f"unknown attention backend {backend!r} for an mmspec model; choose from "
                         f"{', '.join(sorted(registered_backends()))} (diffusers' 'native' = 'sdpa').")
    return name


class AttentionBackendMixin:
    """`set_attention_backend` / `reset_attention_backend` for models with an `attention_backend` attribute
    (None = `mmspec.attention.default_backend()`); see the module docstring."""

    attention_backend: str | None

    def set_attention_backend(self, backend: str) -> None:
        name = mmspec_backend_name(backend)
        check_backend_usable(name, self.device)
        self._set_backend(name)

    def reset_attention_backend(self) -> None:
        self._set_backend(None)

    def _set_backend(self, name: str | None) -> None:
        for module in self.modules():
            if module is self or hasattr(module, "attention_backend"):
                module.attention_backend = name


class FixedAttentionMixin:
    """For models whose attention is another library's: `set_attention_backend` says so instead of doing
    nothing. `attention_owner` names whose attention it is."""

    attention_owner = "torch's scaled_dot_product_attention"

    def set_attention_backend(self, backend: str) -> None:
        raise InputError(f"{type(self).__name__} runs {self.attention_owner} only; it has no attention backend "
                         "to choose (SDPA already picks a fused kernel for the device).")

    def reset_attention_backend(self) -> None:
        """Nothing to reset: the one attention there is."""
