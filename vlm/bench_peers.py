"""transformers' own decoding as peer methods of the `vlm` bench family, run on the same target, prompts and
settings as mmspec's methods in the same process:

- `hf_generate`: `model.generate(**processor_outputs)` on the bench's left-padded batch.
- `hf_prompt_lookup`: `model.generate(..., prompt_lookup_num_tokens=K)` (param `num_tokens`, default 10), one
  row at a time (transformers' limit). transformers 5.23's n-gram candidates copy `<image>` ids from the prompt,
  and the next forward fails ("Image features and image tokens do not match") on every world question; param
  `suppress_image_token` (default 1) passes `suppress_tokens=[image id]`, which transformers' candidate search
  also reads as forbidden, so candidates stop before an `<image>` id (the target then never emits `<image>`,
  which the exactness figure would show); 0 runs transformers as it is.
- `hf_assisted`: `model.generate(..., assistant_model=A)`, one row at a time: A = the target truncated to its
  first `layers` (default 1) text layers, sharing its vision tower, projector, norm and head (no small model of
  the world tokenizer ships, so the draft is the target's own first layers, LayerSkip-style, untrained).

Their outputs are checked against vanilla's by the family's `exactness` figure (greedy: 1.0 expected). Target
forwards are counted by a forward hook on the target (the assistant's calls are draft forwards). A row on which
transformers raises gets no tokens and counts in the `transformers_errors` figure (the
fraction of rows); the first error's message is kept in the output.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmspec.bench.registry import BenchSettings, Method, MethodOutput, Sample
from mmspec.stats import SpecStats

PEERS = {"hf_generate": {}, "hf_prompt_lookup": {"num_tokens": 10, "suppress_image_token": 1},
         "hf_assisted": {"layers": 1}}


def truncated_assistant(model, layers: int):
    """The target with only its first `layers` text layers (a LlavaForConditionalGeneration / Qwen2-VL sharing
    the target's weights; eval mode)."""
    config = copy.deepcopy(model.config)
    config.text_config.num_hidden_layers = layers
    if getattr(config.text_config, "layer_types", None):
        config.text_config.layer_types = config.text_config.layer_types[:layers]
    assistant = type(model)(config).eval()
    assistant.load_state_dict(model.state_dict(), strict=False)  # the target's layers past `layers` are not used
    return assistant.to(device=model.device, dtype=model.dtype)


def _count_forwards(module) -> tuple[list[int], Any]:
    calls = [0]

    def hook(*_):
        calls[0] += 1

    return calls, module.register_forward_hook(hook)


def _runner(name: str):
    def run(models: dict, batch: Sequence[Sample], settings: BenchSettings, given: Mapping[str, Any]) -> MethodOutput:
        vlm = models["target"]
        model, tok = vlm.model, vlm.processor.tokenizer
        params = {**PEERS[name], **given}
        sampling = dict(do_sample=not settings.greedy, max_new_tokens=settings.max_new_tokens,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        if not settings.greedy:
            sampling.update(temperature=settings.temperature, top_k=0, top_p=models.get("top_p", 1.0))
        extra: dict[str, Any] = {}
        if name == "hf_prompt_lookup":
            extra["prompt_lookup_num_tokens"] = int(params["num_tokens"])
            if int(params["suppress_image_token"]):
                extra["suppress_tokens"] = [vlm.lm.image_token_id]
        assistant = None
        if name == "hf_assisted":
            key = ("assistant", int(params["layers"]))
            if key not in models:  # built once per bench run, not per batch
                models[key] = truncated_assistant(model, int(params["layers"]))
            assistant = models[key]
            extra["assistant_model"] = assistant
        examples = [s.data for s in batch]
        rows = [list(range(len(examples)))] if name == "hf_generate" else [[i] for i in range(len(examples))]
        tokens: list[list[int]] = [[] for _ in examples]
        errors: list[str] = []
        target_calls, target_hook = _count_forwards(model)
        draft_calls, draft_hook = _count_forwards(assistant) if assistant is not None else ([0], None)
        side = tok.padding_side
        tok.padding_side = "left"
        torch.manual_seed(settings.seed)
        try:
            for group in rows:
                texts = [vlm.prompt_text(examples[i].prompt) for i in group]
                enc = vlm.processor(images=[examples[i].image for i in group], text=texts, padding=True,
                                    return_tensors="pt").to(model.device)
                try:
                    with torch.no_grad():
                        out = model.generate(**enc, **sampling, **extra)
                except (ValueError, RuntimeError, IndexError) as err:  # transformers' own failures, reported
                    errors.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
                    continue
                for row, i in enumerate(group):
                    new = out[row, enc["input_ids"].shape[1]:].tolist()
                    tokens[i] = new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new
        finally:
            tok.padding_side = side
            target_hook.remove()
            if draft_hook is not None:
                draft_hook.remove()
        stats = SpecStats(num_target_forwards=target_calls[0], num_draft_forwards=draft_calls[0])
        failed = [not t for t in tokens]
        outputs = [{"tokens": t, "text": tok.decode(t, skip_special_tokens=True).strip(), "short": ex.qa.short,
                    "drafter_image_tokens": None, "transformers_error": bad, "error": errors[0] if errors else ""}
                   for t, ex, bad in zip(tokens, examples, failed)]
        return MethodOutput(outputs=outputs, new_tokens=[len(t) for t in tokens], stats=stats)

    return run


def peer_methods() -> dict[str, Method]:
    descriptions = {"hf_generate": "transformers' own generate (vanilla), batched",
                    "hf_prompt_lookup": "transformers' prompt lookup decoding (batch 1 per row)",
                    "hf_assisted": "transformers' assisted generation, the target's first layers as assistant "
                                   "(batch 1 per row)"}
    return {name: Method(_runner(name), lossless=True, params=dict(params), description=descriptions[name])
            for name, params in PEERS.items()}
