"""`SpeculativeVLM`: batched generation from a VLM target (LLaVA-1.5, Qwen2-VL / Qwen2.5-VL: `vlm.target`) with or
without a speculative drafter.

    vlm = SpeculativeVLM.from_pretrained("assets/vlm", drafter="eagle")        # or a converted llava-hf folder
    out = vlm.generate(images, ["What color is the object? Answer in detail."] * len(images), max_new_tokens=96)
    out.texts, out.stats.mean_acceptance_length, out.rounds[0]                 # rounds: tokens per draft round

Prompts without the image marker are formatted by the tokenizer's chat template when it has one, else wrapped in
LLaVA-1.5's conversation format (`vlm.world.build_prompt`: "USER: <image>\\n{prompt} ASSISTANT:", with the model's
image marker: Qwen2-VL's is `<|vision_start|><|image_pad|><|vision_end|>`); prompts that contain it are used as
given. An image of None (or images=None) makes a text-only row. Rows are right-padded and
generated together in batches of `batch_size` (transformers' own assisted generation refuses batches > 1).
Verification is the core's: `lossless` tree verification (greedy at temperature 0, exact rejection sampling
otherwise), so the texts are what the target alone would produce (token for token at temperature 0, in
distribution otherwise). `stream(row, text, token_ids)` is called after every draft-verify round with each row's
newly committed text and tokens (the round's accepted drafts, then the target's own token);
`rounds[i]` lists row i's tokens grouped by the round that committed them (a UI can colour them).

Folder layout: the target (a transformers VLM folder with its processor) at the root, drafters in
`drafters/<kind>/` (`mmspec train vlm-drafter --kind eagle --target DIR`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmspec.budget import check_budget_mode, make_budget
from mmspec.errors import check, check_positive_int
from mmspec.hf_loading import load_transformers_folder, read_folder_config, resolve_model_folder
from mmspec.lm import LMTarget, NoDrafter
from mmspec.loop import generate
from mmspec.sampling import EXACT_MODES, SamplingParams
from mmspec.stats import SpecStats
from vlm.family import ALL_KINDS, TRAINING_FREE_KINDS, drafter_model, training_free_drafter
from vlm.hf_generate import HFCall, StreamerBridge, prepare_call, refused_with_prompts
from vlm.target import VLMInputs, cached_vlm, check_supported_config, prefill_vlm
from vlm.world import build_prompt, image_marker


@dataclass
class VLMOutput:
    texts: list[str]
    token_ids: list[list[int]]  # per row, generated tokens (the final <eos> included when reached)
    rounds: list[list[list[int]]] = field(default_factory=list)  # per row: tokens committed by each round
    stats: SpecStats = field(default_factory=SpecStats)


def load_drafter(folder: str | Path, kind: str, dtype: torch.dtype | None = None):
    """A drafter of `kind` saved in `folder` (not yet attached to a target), in `dtype` when given."""
    model = drafter_model(kind)
    folder = Path(folder)
    check((folder / "config.json").is_file(),
          f"no {kind} drafter in {folder} (config.json missing); train one with "
          f"`mmspec train vlm-drafter --kind {kind} --target TARGET_DIR`.")
    with warnings.catch_warnings():  # diffusers >= 0.36 prefers `dtype`; `torch_dtype` works on every version
        warnings.simplefilter("ignore", FutureWarning)
        return model.from_pretrained(folder, **({} if dtype is None else {"torch_dtype": dtype}))


def piece_text(tokenizer, ids: list[int]) -> str:
    """The text of a piece of an answer WITH its leading space: `decode` drops the word-start space of a
    SentencePiece / Metaspace first token ("▁red" -> "red"), which would glue streamed pieces together."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    first = tokenizer.convert_ids_to_tokens(ids[:1]) if ids else []
    if first and isinstance(first[0], str) and first[0].startswith("\u2581") and not text.startswith(" "):
        text = " " + text
    return text


class SpeculativeVLM:
    """A LLaVA target (transformers model + processor) and an optional drafter; see the module docstring."""

    def __init__(self, target, processor, drafter=None, *, attention_backend: str | None = None) -> None:
        self.model = target.eval()
        self.processor = processor
        self.lm = cached_vlm(self.model, attention_backend)
        self.drafter = None if drafter is None else drafter.eval().attach(self.lm)
        self.budgets: dict = {}  # budget="auto": what each draft budget learnt, kept between calls
        # a batch's finished answers leave it, so its later steps compute only the rows still generating (the same
        # tokens; `mmspec.loop.generate`'s drop_finished); False keeps every row to the end, as transformers does
        self.drop_finished = True
        self.image_tokens_per_image: float | None = None  # of the last encoded batch (drafter_image_tokens)
        self.last_stats: SpecStats | None = None  # of the last generate call
        self.folder: Path | None = None  # the folder `from_pretrained` read (its drafters/ hold the saved drafters)

    @classmethod
    def from_pretrained(cls, folder: str | Path, drafter: str | None = None, *, drafter_path: str | Path | None = None,
                        device: str | torch.device | None = None, attention_backend: str | None = None,
                        dtype: torch.dtype | None = None, torch_dtype: torch.dtype | None = None,
                        device_map: str | dict | None = None) -> SpeculativeVLM:
        """The target in `folder` (and its processor); `drafter` a kind from `folder/drafters/<kind>` or from
        `drafter_path`. `folder` and `drafter_path` are folders or hub ids ("llava-hf/llava-1.5-7b-hf", optionally
        "@revision") found in the local Hugging Face cache (`mmspec.hf_loading.resolve_model_folder`: never a
        download). Both in `dtype` (transformers' older name: `torch_dtype`) when given (else as saved); on `device`
        (default cpu), or placed by transformers' `device_map` (accelerate; every module on one device: mmspec's
        cached forward runs on one), the drafter beside the target."""
        from transformers import AutoModelForImageTextToText, AutoProcessor

        check(dtype is None or torch_dtype is None, "give dtype or torch_dtype, not both.")
        check(device is None or device_map is None, "give device or device_map, not both.")
        dtype = dtype if torch_dtype is None else torch_dtype
        folder = resolve_model_folder(folder, "the VLM target")
        config = read_folder_config(folder, "VLM target", f"`mmspec train vlm --out {folder}` or transformers' "
                                                           "save_pretrained")
        check_supported_config(config, f"the model in {folder}")  # before any weights load
        draft_folder = None
        if drafter is not None:
            drafter_model(drafter)  # (an unknown kind: one line before any weights load)
            check(drafter not in TRAINING_FREE_KINDS or drafter_path is None,
                  f"the {drafter} drafter has no weights: drop drafter_path.")
            if drafter not in TRAINING_FREE_KINDS:
                draft_folder = (folder / "drafters" / drafter if drafter_path is None
                                else resolve_model_folder(drafter_path, f"the {drafter} drafter"))
        # transformers' own class for the config's model_type (checked above to be a supported one)
        options = {k: v for k, v in (("dtype", dtype), ("device_map", device_map)) if v is not None}
        model, processor = load_transformers_folder(folder, AutoModelForImageTextToText, AutoProcessor, **options)
        places = set(getattr(model, "hf_device_map", {}).values())
        check(len(places) <= 1, f"device_map put the model on {len(places)} devices ({sorted(map(str, places))}); "
                                "mmspec's cached forward runs on one: give one device (device_map='cuda:0').")
        if device_map is None:
            model = model.to(device or "cpu")
        draft = None if draft_folder is None else load_drafter(draft_folder, drafter, dtype)
        if drafter in TRAINING_FREE_KINDS:
            draft = training_free_drafter(drafter)  # built, not loaded: its default settings
        vlm = cls(model, processor, draft, attention_backend=attention_backend)
        if vlm.drafter is not None:
            vlm.drafter.to(vlm.lm.device)
        vlm.folder = folder
        return vlm

    def to(self, device: str | torch.device | torch.dtype | None = None, dtype: torch.dtype | None = None
           ) -> SpeculativeVLM:
        """Move and / or cast the target and the drafter in place (`nn.Module.to`; `to(torch.bfloat16)` casts);
        returns self. The budget's timings of this object are dropped (they were for the old place)."""
        if isinstance(device, torch.dtype):
            check(dtype is None, "give the dtype once.")
            device, dtype = None, device
        options = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        self.model.to(**options)
        if self.drafter is not None:
            self.drafter.to(**options)
        self.budgets.clear()
        return self

    # --------------------------------------------------------------------------------------------- inputs
    def drafter_image_tokens(self) -> float | None:
        """How many image tokens the drafter attends to per row (its prefill cost): EagleVLM and MSD all of them,
        ViSpec its compressed tokens, SpecVLM the size its gate chose (the last batch's rows averaged); None
        without a drafter or before any image was encoded."""
        if self.drafter is None or self.image_tokens_per_image is None:
            return None
        return self.drafter.image_tokens_attended(self.image_tokens_per_image)

    def image_marker(self) -> str:
        """What one image is in a prompt's text before the processor expands it (`vlm.world.image_marker`)."""
        return image_marker(self.processor)

    def prompt_text(self, prompt: str, with_image: bool = True, images: int = 1) -> str:
        """`prompt` as the target reads it. A prompt holding the image marker is used as given (`<image>` stands
        for the model's marker, e.g. Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`); any other is a raw
        question, formatted by the tokenizer's chat template when it has one, else by LLaVA-1.5's conversation
        format (`vlm.world.build_prompt`) with the model's image marker (`images` of them, one a line, for a row of
        several images), or without one for a text-only row."""
        check(isinstance(prompt, str) and prompt.strip(), "every prompt must be a non-empty string.")
        marker = self.image_marker()
        if "<image>" in prompt and marker != "<image>" and marker not in prompt:  # world prompts, any model
            prompt = prompt.replace("<image>", marker)
        if marker in prompt or getattr(self.processor, "image_token", "<image>") in prompt:
            check(with_image, f"a prompt holds the image marker {marker!r} but its image is None.")
            return prompt
        if getattr(self.processor.tokenizer, "chat_template", None):
            content = [{"type": "image"}] * (images if with_image else 0) + [{"type": "text", "text": prompt.strip()}]
            return self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                      add_generation_prompt=True, tokenize=False)
        text = build_prompt(prompt.strip(), long=False).replace("<image>", "\n".join([marker] * images))
        return text if with_image else text.replace(f"{marker}\n", "")

    def conversation_text(self, history: Sequence[tuple[str, str]], question: str, images: int = 1) -> str:
        """The prompt of a later question of a conversation about its image(s), as the target reads it: the earlier
        exchanges (question, answer), the image in the first user turn, then `question`; by the tokenizer's chat
        template when it has one, else LLaVA-1.5's conversation format (`USER: <image>\nq1 ASSISTANT: a1</s>USER:
        q2 ASSISTANT:`, the tokenizer's eos after each answer); `images` of them in a row of several. No history:
        `prompt_text(question)`."""
        if not history:
            return self.prompt_text(question, images=images)
        tok = self.processor.tokenizer
        if getattr(tok, "chat_template", None):
            messages = []
            for n, (asked, answer) in enumerate(history):
                content = [{"type": "image"}] * (images if n == 0 else 0) + [{"type": "text", "text": asked.strip()}]
                messages += [{"role": "user", "content": content},
                             {"role": "assistant", "content": [{"type": "text", "text": answer.strip()}]}]
            messages.append({"role": "user", "content": [{"type": "text", "text": question.strip()}]})
            return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text = self.prompt_text(history[0][0], images=images)
        for (_, answer), asked in zip(history, [q for q, _ in history[1:]] + [question]):
            text += f" {answer.strip()}{tok.eos_token}USER: {asked.strip()} ASSISTANT:"
        return text

    def encode(self, images: Sequence | None, prompts: Sequence[str]) -> VLMInputs:
        """Right-padded VLMInputs for images (per prompt: a PIL image, uint8 [3, H, W] tensor or array, a list of
        them for a row of several images, or None for a text-only row; images=None for all) and prompts."""
        images = [None] * len(prompts) if images is None else list(images)
        check(len(images) == len(prompts), f"{len(images)} images for {len(prompts)} prompts; give one image "
                                           "(a list for several, or None) per prompt.")
        per_row = [[] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
                   for image in images]
        texts = [self.prompt_text(p, bool(row), max(1, len(row))) for row, p in zip(per_row, prompts)]
        given = [image for row in per_row for image in row]
        tok = self.processor.tokenizer
        side = tok.padding_side
        tok.padding_side = "right"
        try:
            if given and self.lm.images_nested_per_row:  # processors that want a list of images per prompt
                given = per_row
            enc = self.processor(images=given or None, text=texts, return_tensors="pt", padding=True)
        finally:
            tok.padding_side = side
        if given:
            n_images = sum(map(len, per_row))
            self.image_tokens_per_image = float((enc["input_ids"] == self.lm.image_token_id).sum()) / n_images
        extras = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "pixel_values")
                  and isinstance(v, torch.Tensor)}
        return VLMInputs(enc["input_ids"], enc["attention_mask"], enc.get("pixel_values"), extras)

    def max_positions(self) -> int | None:
        """The positions the target's text model has (`max_position_embeddings`), None where its config names none."""
        config = getattr(self.model.config, "text_config", None) or self.model.config
        return getattr(config, "max_position_embeddings", None)

    def check_room(self, inputs: VLMInputs, max_new_tokens: int, first_row: int = 0) -> None:
        """InputError (one line) when a row's prompt, its image tokens included, plus max_new_tokens exceeds the
        target's positions: past them a model answers from positions it never learnt."""
        limit = self.max_positions()
        if limit is None:
            return
        row = int(inputs.lengths.argmax())
        length = int(inputs.lengths[row])
        check(length + max_new_tokens <= limit,
              f"prompt {first_row + row} is {length} tokens (its image's included) and max_new_tokens is "
              f"{max_new_tokens}: {length + max_new_tokens} positions, but the model has {limit}; shorten the prompt "
              "or lower max_new_tokens.")

    # ------------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, images: Sequence | None = None, prompts: Sequence[str] | None = None,
                 max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, tree: tuple[int | None, int | None, int | None] | None = None,
                 batch_size: int = 8, generator: torch.Generator | None = None, use_drafter: bool = True,
                 stream: Callable[[int, str, list[int]], None] | None = None,
                 child_ranking: str = "raw", budget: str | None = None, *, accept: str = "coupled",
                 num_speculative_tokens: int | None = None, method: str | None = None, **transformers_kwargs):
        """Two forms. `generate(images, prompts, ...)`: answers for (image, prompt) pairs (an image may be None:
        a text-only row, or a list of images: a row of several) as a `VLMOutput`; temperature (default 0: greedy),
        top_p, top_k; max_new_tokens default 128. `generate(**processor_outputs, ...)` (or `generate(input_ids,
        ...)`): transformers' form (`vlm.hf_generate`): the processor's input_ids, attention_mask, pixel_values and
        other model inputs, and every keyword of transformers' `generate` (generation_config, its fields,
        logits_processor, stopping_criteria, prefix_allowed_tokens_fn, streamer, tokenizer for stop_strings),
        honoured as `model.generate` does or refused in one line; the result is what `model.generate` returns, the
        statistics stay in `self.last_stats`.

        Both: `tree` = (depth, top_k, total_tokens) of the EAGLE-2 draft tree, depth in drafted levels (EAGLE's
        code's depth + 1); None (or a None entry) takes the drafter's paper setting (`official_tree`);
        `num_speculative_tokens=K` (vLLM's name) = a chain of K drafts, (K, 1, K + 1); `method` (vLLM's name)
        must be the loaded drafter's kind. `child_ranking` "raw" (EAGLE's) or "processed"
        (`mmspec.feature_drafter`); `use_drafter=False` decodes with the target alone (vanilla). `budget`: "auto"
        (the default, None, for these lossless rules) lets `mmspec.budget` pick each step's shape inside `tree`
        (chains, smaller trees or a plain step) from this device's timed costs and the acceptance seen so far, in
        this call and earlier ones of this object (`self.budgets`; the first call per batch size times the shapes, a
        few seconds, then they are cached on disk); "fixed" drafts `tree` every step. Lossless either way
        (docs/budgets.md). `accept`: the exact acceptance mode, "coupled" (the default: the target's own sample at
        every index, so the answers `use_drafter=False` gives with the same generator(s), whatever the drafter or the
        budget draft; `mmspec.verify.coupled`) or "lossless" (speculative sampling); greedy verification at
        temperature 0 either way."""
        check_positive_int("batch_size", batch_size)
        check_budget_mode(budget)
        check(accept in EXACT_MODES, f"accept must be one of {', '.join(EXACT_MODES)}, got {accept!r}.")
        tree = self.speculative_tree(tree, num_speculative_tokens, method)
        if isinstance(images, torch.Tensor) and prompts is None and not images.is_floating_point():
            check("input_ids" not in transformers_kwargs, "give input_ids once.")
            transformers_kwargs["input_ids"], images = images, None  # generate(input_ids, ...), as transformers
        if "input_ids" in transformers_kwargs or "inputs" in transformers_kwargs:
            check(images is None and prompts is None, "give either the processor's outputs (input_ids=...) or "
                                                      "images and prompts, not both.")
            check(stream is None, "stream= goes with images and prompts; with the processor's outputs pass a "
                                  "transformers streamer=.")
            check(batch_size == 8, "batch_size goes with images and prompts; the processor's batch runs as one.")
            settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
            transformers_kwargs.update({k: v for k, v in settings.items() if v is not None})
            return self._generate_from_model_inputs(transformers_kwargs, tree, generator, use_drafter,
                                                    child_ranking, budget, accept)
        check(not transformers_kwargs, refused_with_prompts(sorted(transformers_kwargs)))
        check(prompts is not None and len(prompts) > 0, "no prompts given.")
        images = [None] * len(prompts) if images is None else list(images)
        check(len(images) == len(prompts), f"{len(images)} images for {len(prompts)} prompts; give one image "
                                           "(a list for several, or None) per prompt.")
        max_new_tokens = 128 if max_new_tokens is None else max_new_tokens
        check_positive_int("max_new_tokens", max_new_tokens)
        params = SamplingParams(0.0 if temperature is None else temperature, top_k or 0,
                                1.0 if top_p is None else top_p)
        eos = self.processor.tokenizer.eos_token_id
        several = next((i for i, image in enumerate(images) if isinstance(image, (list, tuple)) and len(image) > 1),
                       None)
        check(several is None or not (use_drafter and getattr(self.drafter, "one_image_run", False)),
              f"row {several} holds several images, but this {type(self.drafter).__name__} lays out one image run a "
              "row; give it one image, or use an eagle, msd or eagle3 drafter (use_drafter=False: the target alone).")
        out = VLMOutput([], [], [], SpecStats())
        batches = []  # every batch encoded and checked before any is generated
        for start in range(0, len(prompts), batch_size):
            rows = range(start, min(start + batch_size, len(prompts)))
            batches.append((start, self.encode([images[i] for i in rows], [prompts[i] for i in rows])))
            self.check_room(batches[-1][1], max_new_tokens, start)
        for start, inputs in batches:
            part = self._generate_batch(inputs, params, max_new_tokens, tree, generator, use_drafter, eos,
                                        stream, start, child_ranking, budget, accept)
            for field_name in ("texts", "token_ids", "rounds"):
                getattr(out, field_name).extend(getattr(part, field_name))
            out.stats = out.stats + part.stats
        self.last_stats = out.stats
        return out

    def speculative_tree(self, tree, num_speculative_tokens: int | None, method: str | None) -> tuple:
        """The (depth, top_k, total_tokens) a call drafts with: `tree`, or vLLM's num_speculative_tokens=K as a
        chain of K; `method` checked against the loaded drafter's kind."""
        if method is not None:
            loaded = [k for k in ALL_KINDS if self.drafter is not None and type(self.drafter) is drafter_model(k)]
            check(loaded == [method], f"method {method!r} asked for, but the loaded drafter is "
                                      f"{loaded[0] if loaded else 'none'}; load it with drafter={method!r}.")
        if num_speculative_tokens is not None:
            check(tree is None, "give tree or num_speculative_tokens, not both.")
            check_positive_int("num_speculative_tokens", num_speculative_tokens)
            return (num_speculative_tokens, 1, num_speculative_tokens + 1)
        tree = (None, None, None) if tree is None else tree
        check(isinstance(tree, (tuple, list)) and len(tree) == 3,
              f"tree must be (depth, top_k, total_tokens) or None, got {tree!r}.")
        return tuple(tree)

    def _generate_from_model_inputs(self, kwargs: dict, tree, generator, use_drafter: bool, child_ranking: str,
                                    budget: str | None, accept: str = "coupled"):
        """`generate(**processor_outputs, ...)`: transformers' call (`vlm.hf_generate`)."""
        streamer = kwargs.pop("streamer", None)
        call = prepare_call(self.model, self.processor.tokenizer, kwargs)
        batch = call.inputs
        self.check_room(batch, call.max_new_tokens)
        bridge = None
        if streamer is not None:
            check(batch.input_ids.shape[0] == 1, f"transformers' streamers take one row; got a batch of "
                                                 f"{batch.input_ids.shape[0]}.")
            bridge = StreamerBridge(streamer, call.input_ids)
        try:
            part = self._generate_batch(batch, call.draft_params, call.max_new_tokens, tree, generator, use_drafter,
                                        call.eos, bridge, 0, child_ranking, budget, accept, hf_call=call)
        finally:
            if bridge is not None:
                bridge.end()
        self.last_stats = part.stats
        return call.output(part.token_ids)

    def _generate_batch(self, inputs: VLMInputs, params: SamplingParams, max_new_tokens: int, tree, generator,
                        use_drafter: bool, eos: int | list[int] | None, stream, first_row: int,
                        child_ranking: str = "raw", budget: str | None = None, accept: str = "coupled",
                        hf_call: HFCall | None = None) -> VLMOutput:
        """One batch through the loop; `params` the drafter's (and, without `hf_call`, the target's) sampling
        settings; `hf_call`: a transformers call's target settings, logits processors and stopping criteria."""
        depth, top_k, total = tree
        b = inputs.input_ids.shape[0]
        if use_drafter and self.drafter is not None:
            drafter = self.drafter.loop_drafter(self.drafter, self.lm, params, top_k=top_k, depth=depth,
                                                total_tokens=total, child_ranking=child_ranking)
        else:
            drafter = NoDrafter()
        target_params = params if hf_call is None else hf_call.target_params
        target = LMTarget(self.lm, target_params, max_new_tokens,
                          max_draft_nodes=getattr(drafter, "max_draft_nodes", 1), prefill_fn=prefill_vlm)
        target.logits_hook = None if hf_call is None else hf_call.logits
        rounds: list[list[list[int]]] = [[] for _ in range(b)]  # per row: the tokens of each round
        seen = [0] * b
        tok = self.processor.tokenizer

        def take(tokens: list[list[int]], counts: list[int]) -> None:
            """Move each row's newly committed tokens into `rounds` (the prefill's token is its own round) and
            stream them, a round at a time."""
            for row in range(b):
                new = tokens[row][seen[row]: counts[row]]
                groups = [new[:1], new[1:]] if seen[row] == 0 else [new]
                for group in groups:
                    if group:
                        rounds[row].append(group)
                        if stream is not None:
                            stream(first_row + row, piece_text(tok, group), group)
                seen[row] = counts[row]

        counts_per_round: list[torch.Tensor] = []  # without a stream, rounds are cut after the loop

        def record(state, draft, result) -> None:  # (the loop drops finished rows: read the call's whole batch)
            if stream is None:
                counts_per_round.append(state.full_num_generated().clone())
            else:
                take(state.full_output().tolist(), state.full_num_generated().tolist())

        rule = target_params.exact_rule(accept)
        draft_budget = make_budget(budget, target, drafter, rule, b, self.budgets)
        result = generate(target, drafter, rule, inputs, batch_size=b, max_new_tokens=max_new_tokens,
                          generator=generator, eos_token_id=eos, device=self.lm.device, callback=record,
                          budget=draft_budget, drop_finished=self.drop_finished,
                          after_append=None if hf_call is None else hf_call.after_append)
        tokens = result.tokens.tolist()
        for counts in torch.stack(counts_per_round).tolist() if counts_per_round else []:
            take(tokens, counts)
        take(tokens, result.num_generated.tolist())  # the last round (and rows that ended at the prefill's token)
        ids = [result.tokens[row, : int(result.num_generated[row])].tolist() for row in range(b)]
        texts = [tok.decode(row, skip_special_tokens=True).strip() for row in ids]
        return VLMOutput(texts, ids, rounds, result.stats)
