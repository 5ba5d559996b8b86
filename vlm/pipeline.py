"""`SpeculativeVLM`: batched generation from a LLaVA target with or without a speculative drafter.

    vlm = SpeculativeVLM.from_pretrained("assets/vlm", drafter="eagle")        # or a converted llava-hf folder
    out = vlm.generate(images, ["What color is the object? Answer in detail."] * len(images), max_new_tokens=96)
    out.texts, out.stats.mean_acceptance_length, out.rounds[0]                 # rounds: tokens per draft round

Prompts without `<image>` are wrapped in LLaVA-1.5's conversation format (`vlm.world.build_prompt`: "USER:
<image>\\n{prompt} ASSISTANT:"); prompts that contain `<image>` are used as given. Rows are right-padded and
generated together in batches of `batch_size` (transformers' own assisted generation refuses batches > 1).
Verification is the core's: `lossless` tree verification (greedy at temperature 0, exact rejection sampling
otherwise), so the texts are what the target alone would produce (token for token at temperature 0, in
distribution otherwise). `stream(row, text, token_ids)` is called after every draft-verify round with each row's
newly committed text and tokens (the round's accepted drafts, then the target's own token);
`rounds[i]` lists row i's tokens grouped by the round that committed them (a UI can colour them).

Folder layout: the target (a `LlavaForConditionalGeneration` folder with its processor) at the root, drafters in
`drafters/<kind>/` (`mmspec train vlm-drafter --kind eagle --target DIR`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmspec.budget import check_budget_mode, make_budget
from mmspec.errors import InputError, check, check_positive_int
from mmspec.lm import LMTarget, NoDrafter
from mmspec.loop import generate
from mmspec.sampling import SamplingParams
from mmspec.stats import SpecStats
from vlm.family import drafter_model
from vlm.target import LlavaCachedLM, VLMInputs, check_supported_config, prefill_vlm
from vlm.world import build_prompt, num_image_tokens


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
        self.lm = LlavaCachedLM(self.model, attention_backend)
        self.drafter = None if drafter is None else drafter.eval().attach(self.lm)
        self.budgets: dict = {}  # budget="auto": what each draft budget learnt, kept between calls

    @classmethod
    def from_pretrained(cls, folder: str | Path, drafter: str | None = None, *, drafter_path: str | Path | None = None,
                        device: str = "cpu", attention_backend: str | None = None,
                        dtype: torch.dtype | None = None) -> SpeculativeVLM:
        """The target in `folder` (and its processor); `drafter` a kind from `folder/drafters/<kind>` or from
        `drafter_path`; both in `dtype` when given (else as saved). Local files only."""
        from transformers import LlavaForConditionalGeneration, LlavaProcessor
        from transformers.utils import logging as hf_logging

        folder = Path(folder)
        check((folder / "config.json").is_file() and (folder / "processor_config.json").is_file(),
              f"no VLM target in {folder}: expected a LlavaForConditionalGeneration folder with its processor "
              f"(made by `mmspec train vlm --out {folder}` or transformers' save_pretrained).")
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise InputError(f"could not read {folder / 'config.json'}: {err}") from None
        check_supported_config(config, f"the model in {folder}")  # before any weights load
        hf_logging.disable_progress_bar()
        try:
            model = LlavaForConditionalGeneration.from_pretrained(str(folder), local_files_only=True)
            processor = LlavaProcessor.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as err:
            raise InputError(f"could not load the VLM target in {folder}: {str(err).splitlines()[0]}") from None
        finally:
            hf_logging.enable_progress_bar()
        draft = None
        if drafter is not None:
            draft = load_drafter(drafter_path or folder / "drafters" / drafter, drafter, dtype).to(device)
        model = model.to(device) if dtype is None else model.to(device=device, dtype=dtype)
        return cls(model, processor, draft, attention_backend=attention_backend)

    # --------------------------------------------------------------------------------------------- inputs
    def drafter_image_tokens(self) -> float | None:
        """How many image tokens the drafter attends to per row (its prefill cost): EagleVLM and MSD all of them,
        ViSpec its one compressed token, SpecVLM the size its gate chose (the last batch's rows averaged); None
        without a drafter."""
        if self.drafter is None:
            return None
        return self.drafter.image_tokens_attended(num_image_tokens(self.processor))

    def prompt_text(self, prompt: str) -> str:
        check(isinstance(prompt, str) and prompt.strip(), "every prompt must be a non-empty string.")
        return prompt if "<image>" in prompt else build_prompt(prompt.strip(), long=False)

    def encode(self, images: Sequence, prompts: Sequence[str]) -> VLMInputs:
        """Right-padded VLMInputs for images (PIL images, uint8 [3, H, W] tensors or arrays) and prompts."""
        check(len(images) == len(prompts), f"{len(images)} images for {len(prompts)} prompts; give one image "
                                           "per prompt.")
        tok = self.processor.tokenizer
        side = tok.padding_side
        tok.padding_side = "right"
        try:
            enc = self.processor(images=list(images), text=[self.prompt_text(p) for p in prompts],
                                 return_tensors="pt", padding=True)
        finally:
            tok.padding_side = side
        return VLMInputs(enc["input_ids"], enc["attention_mask"], enc["pixel_values"])

    # ------------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, images: Sequence, prompts: Sequence[str], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 tree: tuple[int | None, int | None, int | None] | None = None,
                 batch_size: int = 8, generator: torch.Generator | None = None, use_drafter: bool = True,
                 stream: Callable[[int, str, list[int]], None] | None = None,
                 child_ranking: str = "raw", budget: str | None = "auto") -> VLMOutput:
        """Answers for (image, prompt) pairs; `tree` = (depth, top_k, total_tokens) of the EAGLE-2 draft tree, depth
        in drafted levels (EAGLE's code's depth + 1); None (or a None entry) takes the drafter's paper setting
        (`official_tree`); `child_ranking` "raw" (EAGLE's) or "processed" (`mmspec.feature_drafter`);
        `use_drafter=False` decodes with the target alone (vanilla). `budget`: "auto" (default) lets
        `mmspec.tree_budget.TreeBudget` pick each step's shape inside `tree` (chains, smaller trees or a plain
        step) from this device's timed costs and the acceptance seen so far, in this call and earlier ones of this
        object (`self.budgets`; the first call per batch size times the shapes, a few seconds, then they are cached
        on disk); "fixed" drafts `tree` every step (and a seeded sampled call then repeats exactly). Lossless
        either way (docs/budgets.md)."""
        check(len(images) == len(prompts), f"{len(images)} images for {len(prompts)} prompts; give one image "
                                           "per prompt.")
        check(len(prompts) > 0, "no prompts given.")
        check_positive_int("max_new_tokens", max_new_tokens)
        check_positive_int("batch_size", batch_size)
        check_budget_mode(budget)
        tree = (None, None, None) if tree is None else tree
        check(isinstance(tree, (tuple, list)) and len(tree) == 3,
              f"tree must be (depth, top_k, total_tokens) or None, got {tree!r}.")
        params = SamplingParams(temperature, top_k, top_p)
        eos = self.processor.tokenizer.eos_token_id
        out = VLMOutput([], [], [], SpecStats())
        for start in range(0, len(prompts), batch_size):
            rows = range(start, min(start + batch_size, len(prompts)))
            inputs = self.encode([images[i] for i in rows], [prompts[i] for i in rows])
            part = self._generate_batch(inputs, params, max_new_tokens, tree, generator, use_drafter, eos,
                                        stream, start, child_ranking, budget)
            for field_name in ("texts", "token_ids", "rounds"):
                getattr(out, field_name).extend(getattr(part, field_name))
            out.stats = out.stats + part.stats
        return out

    def _generate_batch(self, inputs: VLMInputs, params: SamplingParams, max_new_tokens: int, tree, generator,
                        use_drafter: bool, eos: int | None, stream, first_row: int,
                        child_ranking: str = "raw", budget: str | None = "auto") -> VLMOutput:
        depth, top_k, total = tree
        b = inputs.input_ids.shape[0]
        if use_drafter and self.drafter is not None:
            drafter = self.drafter.loop_drafter(self.drafter, self.lm, params, top_k=top_k, depth=depth,
                                                total_tokens=total, child_ranking=child_ranking)
        else:
            drafter = NoDrafter()
        target = LMTarget(self.lm, params, max_new_tokens, max_draft_nodes=getattr(drafter, "max_draft_nodes", 1),
                          prefill_fn=prefill_vlm)
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

        def record(state, draft, result) -> None:
            if stream is None:
                counts_per_round.append(state.num_generated.clone())
            else:
                take(state.output.tolist(), state.num_generated.tolist())

        draft_budget = make_budget(budget, target, drafter, "lossless", inputs, b, self.lm.device, self.budgets)
        result = generate(target, drafter, "lossless", inputs, batch_size=b, max_new_tokens=max_new_tokens,
                          generator=generator, eos_token_id=eos, device=self.lm.device, callback=record,
                          budget=draft_budget)
        tokens = result.tokens.tolist()
        for counts in torch.stack(counts_per_round).tolist() if counts_per_round else []:
            take(tokens, counts)
        take(tokens, result.num_generated.tolist())  # the last round (and rows that ended at the prefill's token)
        ids = [result.tokens[row, : int(result.num_generated[row])].tolist() for row in range(b)]
        texts = [tok.decode(row, skip_special_tokens=True).strip() for row in ids]
        return VLMOutput(texts, ids, rounds, result.stats)
