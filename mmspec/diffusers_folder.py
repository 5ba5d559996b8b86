"""Pipeline folders that diffusers' own `DiffusionPipeline.from_pretrained` loads, and the diffusers call
conventions every mmspec pipeline shares (`MMSpecPipelineMixin`).

diffusers resolves a folder's pipeline class from `model_index.json`'s `_class_name`: a name is looked up in the
diffusers package itself (where mmspec's classes are not), a `[module, class]` pair names a custom pipeline file in
the folder. So every folder an mmspec pipeline saves holds

    model_index.json   "_class_name": ["mmspec_pipeline", "LlamaGenPipeline"]
    mmspec_pipeline.py from image_ar.llamagen.pipeline import LlamaGenPipeline   (one import of installed mmspec)

and loads with either

    LlamaGenPipeline.from_pretrained(folder)                                # mmspec's class: nothing else needed
    DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)       # diffusers' entry point

diffusers (>= 0.30) runs a folder's own .py file only with `trust_remote_code=True`; without it, its error names
the flag and the file to inspect. There is no way to load a class diffusers does not ship without that flag (or
`custom_pipeline=`); the file holds nothing but the import. mmspec's own classes read the pair as their name and
never run the file. Folders written before 2026-11-24 (a plain class name) still load with mmspec's classes.

Call conventions (the mixin):
- `callback_on_step_end`: a function `(pipe, step, num_tokens, {"tokens": ...})` or one of diffusers'
  `PipelineCallback` / `MultiPipelineCallbacks` objects (their `tensor_inputs` are then the inputs asked for);
  `_callback_tensor_inputs` (["tokens"]) is what a pipeline can pass. The third argument, where a diffusion pipeline
  passes the timestep, is the number of tokens made so far (every row). `step_callback` wraps it for a loop.
- `interrupt` / `_interrupt`: a callback sets `pipe._interrupt = True` to end the call after the current step, as in
  diffusers (so does returning {"stop": True}); `num_timesteps`: the call's vanilla step count (tokens for LlamaGen
  and CSpD, scales for VAR, `num_iter` for MAR; a speculative call takes fewer steps). What was made so far is
  returned and decoded: VAR the partial f_hat, MAR and CSpD the tokens with the rest zero, LlamaGen the tokens with
  -1 where none was made, decoded from a zero latent vector (Janus and Emu3 decode only a finished call).
- `return_dict=False` returns `(images,)`; `num_inference_steps` is refused in one line before any work (these
  pipelines are autoregressive; `mmspec.pipeline_io`).
- the attention helpers diffusers pipelines have either act (LlamaGen's xformers backend) or raise a one-line error
  saying what to use instead (`enable_attention_slicing`, `enable_xformers_memory_efficient_attention` where the
  models have no backend choice).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmspec.errors import InputError, check

SHIM_MODULE = "mmspec_pipeline"


def cast_like_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` in `dtype` and eval mode as `from_pretrained(torch_dtype=dtype)` leaves it: its
    `_keep_in_fp32_modules` (e.g. VAR's head) stay float32. torch's own cast (diffusers' `to` warns about keeping
    float32 modules even where a model has none)."""
    torch.nn.Module.to(model, dtype=dtype)
    for name in getattr(model, "_keep_in_fp32_modules", None) or ():
        getattr(model, name).float()
    return model.eval()


def pipeline_class_name(value: Any) -> Any:
    """`_class_name` of a model_index.json: the class's name, also from the `[module, class]` pair."""
    return value[1] if isinstance(value, (list, tuple)) and len(value) == 2 else value


def write_diffusers_entry(folder: str | os.PathLike, pipeline_cls: type) -> None:
    """Make `folder` (written by `save_pretrained`) loadable by `DiffusionPipeline.from_pretrained`: the class
    pair in model_index.json and the one-import module it names."""
    folder = Path(folder)
    index = folder / "model_index.json"
    config = json.loads(index.read_text())
    config["_class_name"] = [SHIM_MODULE, pipeline_cls.__name__]
    for name, entry in config.items():  # transformers 5 names its fast tokenizer TokenizersBackend; 4.x cannot load
        if isinstance(entry, list) and entry == ["transformers", "TokenizersBackend"]:
            config[name] = ["transformers", "PreTrainedTokenizerFast"]  # the name both read
    index.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / f"{SHIM_MODULE}.py").write_text(
        f'"""diffusers entry point of this mmspec pipeline folder (`mmspec.diffusers_folder`)."""\n'
        f"from {pipeline_cls.__module__} import {pipeline_cls.__name__}  # noqa: F401\n")


def callback_tensor_inputs(callback: Any, names: list[str] | None) -> list[str] | None:
    """The tensors a callback asks for: a diffusers `PipelineCallback` / `MultiPipelineCallbacks` says it itself."""
    try:
        from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
    except ImportError:  # a diffusers without callback objects
        return names
    if isinstance(callback, (PipelineCallback, MultiPipelineCallbacks)):
        return list(callback.tensor_inputs)
    return names


class MMSpecPipelineMixin:
    """For mmspec's `DiffusionPipeline` subclasses (listed first in the bases): `save_pretrained` writes the
    diffusers entry (`write_diffusers_entry`), `load_config` reads the `[module, class]` pair as the class name;
    the shared call conventions (see the module docstring)."""

    _callback_tensor_inputs = ["tokens"]

    _interrupt: bool = False
    _num_timesteps: int = 0

    @property
    def interrupt(self) -> bool:
        """True once a callback set `pipe._interrupt = True`: the running call stops after its current step."""
        return self._interrupt

    @property
    def num_timesteps(self) -> int:
        """The running (or last) call's vanilla step count (see the module docstring)."""
        return self._num_timesteps

    def check_callback_inputs(self, names: list[str] | None) -> None:
        """`callback_on_step_end_tensor_inputs`: every name must be one this pipeline passes to callbacks."""
        for name in names or []:
            check(name in self._callback_tensor_inputs,
                  f"callback tensor input {name!r} not available; choose from {self._callback_tensor_inputs}.")

    def step_callback(self, callback: Callable[..., Any] | None, tensor_inputs: list[str] | None,
                      num_steps: int) -> Callable[[int, int, dict[str, torch.Tensor]], bool]:
        """Start a call: check the callback's tensor inputs (a diffusers `PipelineCallback` names its own), clear
        `interrupt`, set `num_timesteps`. Returns on_step(step, num_tokens, tensors) -> whether the loop goes on,
        which runs the callback on the asked-for tensors (all of them when none were named)."""
        names = callback_tensor_inputs(callback, tensor_inputs)
        self.check_callback_inputs(names)
        self._interrupt, self._num_timesteps = False, num_steps

        def on_step(step: int, num_tokens: int, tensors: dict[str, torch.Tensor]) -> bool:
            if callback is not None:
                out = callback(self, step, num_tokens, {k: v for k, v in tensors.items() if not names or k in names})
                if isinstance(out, dict) and out.get("stop"):
                    self._interrupt = True
            return not self._interrupt

        return on_step

    def with_token_progress(self, total: int, on_step: Callable[[int, int, dict[str, torch.Tensor]], bool],
                            run: Callable[[Callable[..., bool]], Any]) -> Any:
        """`run(callback)` of a token loop (`mmspec.loop.generate`'s callback) under a progress bar of `total`
        tokens (the slowest row's count), calling `on_step` (from `step_callback`) after every iteration."""
        with self.progress_bar(total=total) as bar:
            def callback(state, draft, result) -> bool:
                done = int(state.num_generated.min())
                bar.update(done - bar.n)
                return on_step(state.iteration - 1, done, {"tokens": state.tokens})

            out = run(callback)
            bar.update(total - bar.n)
        return out

    def enable_attention_slicing(self, slice_size: Any = "auto") -> None:
        raise InputError(f"{type(self).__name__} does not slice attention; lower the batch size (--max-batch, or "
                         "fewer class labels per call) to save memory.")

    def enable_xformers_memory_efficient_attention(self, attention_op: Any = None) -> None:
        """Switch every component model with a backend choice to mmspec's xformers backend (CUDA only)."""
        self._set_attention_backends("xformers")

    def disable_xformers_memory_efficient_attention(self) -> None:
        self._set_attention_backends(None)

    def _set_attention_backends(self, name: str | None) -> None:
        from mmspec.attention.model_backend import AttentionBackendMixin

        models = [m for m in self.components.values() if isinstance(m, AttentionBackendMixin)]
        if not models:
            raise InputError(f"{type(self).__name__}'s models use torch's scaled_dot_product_attention only; there "
                             "is no xformers backend to enable (SDPA already picks a memory-efficient kernel).")
        for model in models:
            if name is None:
                model.reset_attention_backend()
            else:
                model.set_attention_backend(name)  # checked for the model's device first

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        write_diffusers_entry(save_directory, type(self))

    @classmethod
    def load_config(cls, *args: Any, **kwargs: Any) -> Any:
        out = super().load_config(*args, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        if isinstance(config, dict) and "_class_name" in config:
            config["_class_name"] = pipeline_class_name(config["_class_name"])
        return out
