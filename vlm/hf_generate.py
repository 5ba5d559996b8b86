"""transformers' `generate` call for `SpeculativeVLM.generate(**processor_outputs, ...)`: every setting of
transformers' `generate` either behaves as in `model.generate` or is refused in one line before any work.

    enc = processor(images=images, text=texts, padding=True, return_tensors="pt")
    out = vlm.generate(**enc, max_new_tokens=64, do_sample=False)             # [B, P + N], like model.generate
    vlm.generate(**enc, generation_config=GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9))
    vlm.generate(**enc, repetition_penalty=1.2, stop_strings=["."], max_new_tokens=64)
    vlm.generate(**enc, streamer=TextIteratorStreamer(processor.tokenizer, skip_prompt=True))  # batch 1

How: the call is prepared by transformers' own steps (`_prepare_generation_config`: kwargs over generation_config
over the model's generation config over the global defaults; `_validate_model_kwargs`; `_prepare_special_tokens`;
`_expand_inputs_for_generation` for num_return_sequences; `_prepare_generated_length`; `_get_logits_processor`;
`_get_stopping_criteria`), and mmspec's loop then runs with
- transformers' logits processors on the target's logits at every verified position, each on that position's own
  prefix (the prompt as given, the tokens generated, the draft path: `mmspec.prefixes.PrefixLogits`); the
  warpers that read no tokens (temperature, top-k, top-p, min-p, typical-p, ...) run on all positions at once;
- the stopping criteria that are not the loop's own (eos and max_length are) checked after every committed token
  on its prefix (`mmspec.prefixes.first_stops`): stop_strings, max_time and the user's `stopping_criteria`;
- the result transformers returns: the input ids as given, then the new tokens, rows that stopped early padded with
  the pad id (pad_token_id, else the first eos id); `return_dict_in_generate=True` returns transformers'
  `GenerateDecoderOnlyOutput` with `scores` / `logits` per new token ([B, V] each; zeros at a row's positions after
  its end, where `generate` computes scores of pad tokens) when asked; mmspec's statistics are in
  `SpeculativeVLM.last_stats`.
Processors and criteria are called on groups of prefixes of one length (`mmspec.prefixes`); like transformers' own
assisted generation, they must be functions of the prefix and scores they are given. use_cache=False gives the
tokens use_cache=True gives, as in transformers (speculative verification always keeps its KV cache). Refused:
other generation modes (beam search, contrastive search, DoLa, assisted generation) and the settings of
transformers' assisted generation (num_assistant_tokens, assistant_confidence_threshold, ...), output_attentions /
output_hidden_states, guidance_scale, token_healing, SynthID watermarking, negative prompts,
synced_gpus, custom_generate, cache and compile settings of transformers' own loop that the user sets (mmspec runs
its own static KV cache), and stop_strings / stopping_criteria over a batch without an eos id (transformers then
keeps generating the stopped rows).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mmspec.errors import InputError, check
from mmspec.prefixes import PrefixLogits, first_stops
from mmspec.sampling import SamplingParams
from vlm.target import VLMInputs

PER_TOKEN_INPUTS = ("mm_token_type_ids", "token_type_ids")  # [B, P] inputs that move with the tokens
# transformers' warpers and processors that read only the scores, never the tokens: run on every entry at once
ROWWISE = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
           "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "LogitNormalization",
           "InfNanRemoveLogitsProcessor", "SuppressTokensLogitsProcessor")
# settings of transformers' own decoding loop (cache, compilation): refused when the user sets them
LOOP_MECHANICS = ("cache_implementation", "cache_config", "compile_config", "disable_compile", "prefill_chunk_size",
                  "max_cache_len", "continuous_batching_config")
# generate's own keywords that mmspec does not run
REFUSED_ARGUMENTS = {
    "assistant_model": "mmspec's drafter is the assistant; load one with drafter=",
    "assistant_tokenizer": "mmspec's drafter is the assistant; load one with drafter=",
    "negative_prompt_ids": "classifier-free guidance runs a second model pass per token, which mmspec does not verify",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported",
    "custom_generate": "mmspec's loop is the generation method",
    "trust_remote_code": "mmspec runs no remote code",
}
# transformers' assisted-generation settings (its assistant's draft length and schedule, confidence stop, lookbehinds,
# ensemble verification, DFlash): refused when set; mmspec's drafter drafts what budget= and tree= say
ASSISTED_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                     "max_matching_ngram_size", "assistant_lookbehind", "target_lookbehind",
                     "assistant_ensemble_weight", "speculation_type", "is_assistant")
ASSISTED_MODE_SETTINGS = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")  # each makes generate assist
CRITERIA_OF_THE_LOOP = ("MaxLengthCriteria", "EosTokenCriteria")  # mmspec's loop stops at max_new_tokens and eos


GENERATE_KEYWORDS = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                     "streamer", "tokenizer", "synced_gpus", *REFUSED_ARGUMENTS)


def refused_with_prompts(names: list[str]) -> str:
    """The one-line error for keywords `generate(images, prompts, ...)` does not take."""
    from transformers import GenerationConfig

    settings = [n for n in names if n in GENERATE_KEYWORDS or hasattr(GenerationConfig(), n)]
    if settings:
        return (f"{', '.join(settings)}: transformers' generate settings go with the processor's outputs "
                f"(generate(**processor(images=..., text=...), {settings[0]}=...)); with images and prompts use "
                "max_new_tokens, temperature, top_p, top_k and stream=.")
    return (f"unknown argument(s) {', '.join(names)}; model inputs go with input_ids "
            "(generate(**processor(images=..., text=...))).")


@contextmanager
def transformers_errors():
    """transformers' ValueErrors about a call's settings as one-line InputErrors."""
    try:
        yield
    except ValueError as err:
        raise InputError(" ".join(str(err).split())) from None


@dataclass
class HFCall:
    """A transformers `generate` call prepared by transformers' own steps, for mmspec's loop."""

    config: object  # the prepared GenerationConfig
    input_ids: torch.Tensor  # [B, P] as given (repeated for num_return_sequences)
    inputs: VLMInputs  # the same rows right-padded, with the model inputs
    max_new_tokens: int
    eos: list[int] | None
    pad: int
    target_params: SamplingParams  # after the processors: greedy, or the softmax of the processed scores
    draft_params: SamplingParams  # the drafter's q: the config's temperature, top-k and top-p
    logits: PrefixLogits | None  # None: the target's logits need no processing
    stop_fn: Callable | None  # (call_rows [G], ids [G, L]) -> [G] bool: the criteria the loop does not check
    scores: list = field(default_factory=list)  # per call row: per new token (raw logits [V], scores [V])

    def after_append(self, state, before: torch.Tensor, draft, result) -> None:
        """The loop's append hook: record each new token's scores (`return_dict_in_generate`), then end the rows
        whose criteria hold after one of their new tokens."""
        if self.logits is not None and self.logits.record:
            record_scores(self, state, before, draft, result)
        if self.stop_fn is not None:
            state.end_rows(first_stops(self.stop_fn, self.input_ids, state.tokens, before, state.num_generated,
                                       state.row_ids))

    def output(self, token_ids: list[list[int]]):
        """transformers' result: the [B, P + N] tensor, or a `GenerateDecoderOnlyOutput` with scores / logits."""
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        sequences = sequences_tensor(self.input_ids, token_ids, self.pad)
        if not self.config.return_dict_in_generate:
            return sequences
        width = sequences.shape[1] - self.input_ids.shape[1]

        def per_position(which: int, wanted: bool):
            if not wanted:
                return None
            vocab = next((row[0][which].shape[-1] for row in self.scores if row), 0)
            steps = []
            for t in range(width):
                rows = [row[t][which] if t < min(len(row), len(ids)) else torch.zeros(vocab)
                        for row, ids in zip(self.scores, token_ids)]
                steps.append(torch.stack(rows))
            return tuple(steps)

        return GenerateDecoderOnlyOutput(sequences=sequences, scores=per_position(1, self.config.output_scores),
                                         logits=per_position(0, self.config.output_logits))


def record_scores(call: HFCall, state, before: torch.Tensor, draft, result) -> None:
    """Append to `call.scores` the raw and processed logits of each held row's new tokens: the prefill's token came
    from entry 0, a step's token j from entry j (chain) or from the j-th node of the accepted path (tree)."""
    new = (state.num_generated - before).tolist()
    rows = range(len(new)) if state.row_ids is None else state.row_ids.tolist()
    nodes = None if result is None or result.accepted_nodes is None else result.accepted_nodes.tolist()
    picked = [(held, 0 if draft is None else (nodes[held][j] if nodes is not None else j), row)
              for held, (row, count) in enumerate(zip(rows, new)) for j in range(count)]
    if not picked:
        return
    held, entry, _ = (torch.tensor(column) for column in zip(*picked))
    # copies of the picked rows [M, V] (a view would keep each step's whole [B, S, V] logits alive until the end)
    raw, processed = (t[held.to(t.device), entry.to(t.device)].cpu()
                      for t in (call.logits.last_raw, call.logits.last_processed))
    for k, (_, _, row) in enumerate(picked):
        call.scores[row].append((raw[k], processed[k]))


def prepare_call(model, tokenizer, kwargs: dict) -> HFCall:
    """The HFCall of `model.generate(**kwargs)` (kwargs: generate's keywords, GenerationConfig fields and the
    processor's outputs); InputError (one line) for what mmspec does not run, before any work."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.configuration_utils import GenerationMode

    kwargs = dict(kwargs)
    for name, why in REFUSED_ARGUMENTS.items():
        check(kwargs.pop(name, None) is None, f"{name} is not supported: {why}.")
    check(not kwargs.pop("synced_gpus", None), "synced_gpus is not supported: mmspec runs one process per call.")
    generation_config = kwargs.pop("generation_config", None)
    check(generation_config is None or isinstance(generation_config, GenerationConfig),
          f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}.")
    user_processors = kwargs.pop("logits_processor", None) or LogitsProcessorList()
    user_criteria = kwargs.pop("stopping_criteria", None) or StoppingCriteriaList()
    prefix_allowed_tokens_fn = kwargs.pop("prefix_allowed_tokens_fn", None)
    tokenizer = kwargs.pop("tokenizer", None) or tokenizer
    if "inputs" in kwargs:
        check("input_ids" not in kwargs, "give inputs or input_ids, not both.")
        kwargs["input_ids"] = kwargs.pop("inputs")
    user_set = set(kwargs) | ({k for k, v in generation_config.to_diff_dict().items() if v is not None}
                              if generation_config is not None else set())
    defaults = model.generation_config
    no_max_length = kwargs.get("max_length") is None and getattr(generation_config, "max_length", None) is None \
        and defaults.max_length is None
    no_min_length = kwargs.get("min_length") is None and getattr(generation_config, "min_length", None) is None \
        and defaults.min_length is None
    with transformers_errors():
        config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
        config.validate()
    refuse_unsupported(config, user_set, defaults, GenerationMode)
    with transformers_errors():
        model._validate_model_kwargs(dict(model_kwargs))
    ids = model_kwargs.pop("input_ids", None)
    check(isinstance(ids, torch.Tensor) and ids.dim() == 2,
          f"input_ids must be a [B, P] tensor (the processor's output), got {type(ids).__name__}.")
    for name in ("inputs_embeds", "past_key_values", "cache", "cache_position", "position_ids"):
        check(model_kwargs.get(name) is None, f"{name} is not supported: mmspec computes it from input_ids and "
                                              "its own KV cache; pass the processor's outputs.")
    odd = sorted(k for k, v in model_kwargs.items() if v is not None and not isinstance(v, torch.Tensor)
                 and k not in ("output_attentions", "output_hidden_states", "use_cache"))
    check(not odd, f"model input(s) {', '.join(odd)} are not tensors: mmspec passes the processor's tensors to the "
                   "model; drop them.")
    has_mask = model_kwargs.get("attention_mask") is not None
    with transformers_errors():
        prepare_special_tokens(model, config, has_mask, ids.device, ids.shape[0])
        ids, model_kwargs = model._expand_inputs_for_generation(
            input_ids=ids, expand_size=config.num_return_sequences or 1, is_encoder_decoder=False, **model_kwargs)
        prompt_length = ids.shape[1]
        config = model._prepare_generated_length(config, no_max_length, no_min_length, "input_ids",
                                                 prompt_length, ids)
        model._validate_generated_length(config, prompt_length, no_max_length)
        # the whole batch's lists, once: transformers' own checks of the processors and criteria, before any work
        processors = model._get_logits_processor(config, prompt_length, ids, prefix_allowed_tokens_fn,
                                                 user_processors, ids.device, model_kwargs)
        criteria = model._get_stopping_criteria(config, user_criteria, tokenizer)
    eos = config._eos_token_tensor
    eos = None if eos is None else eos.view(-1).tolist()
    extra = [c for c in criteria if type(c).__name__ not in CRITERIA_OF_THE_LOOP]
    check(not [c for c in extra if type(c).__name__ != "MaxTimeCriteria"] or eos is not None or ids.shape[0] == 1,
          "stop_strings / stopping_criteria over a batch need an eos_token_id (without one, transformers keeps "
          "generating the rows they stop); set eos_token_id or generate one row at a time.")
    mask = model_kwargs.pop("attention_mask", None)
    pixels = model_kwargs.pop("pixel_values", None)
    extras = {k: v for k, v in model_kwargs.items() if isinstance(v, torch.Tensor)}
    greedy = not config.do_sample
    pad = config._pad_token_tensor
    call = HFCall(config=config, input_ids=ids, inputs=right_padded(ids, mask, pixels, extras),
                  max_new_tokens=config.max_length - prompt_length, eos=eos,
                  pad=0 if pad is None else int(pad.view(-1)[0]),
                  target_params=SamplingParams(0.0 if greedy else 1.0),
                  draft_params=SamplingParams(0.0) if greedy else SamplingParams(
                      float(config.temperature), int(config.top_k or 0), float(config.top_p)),
                  logits=None, stop_fn=None)
    call.logits = prefix_logits(model, config, processors, ids, mask, prefix_allowed_tokens_fn, user_processors)
    if extra:
        stop_list = StoppingCriteriaList(extra)
        call.stop_fn = lambda rows, prefix: stop_list(prefix, None)
    call.scores = [[] for _ in range(ids.shape[0])]
    return call


def prepare_special_tokens(model, config, has_mask: bool, device, batch: int) -> None:
    """transformers' `_prepare_special_tokens` (eos / pad / bos tensors on the config), with the batch size where
    this transformers version takes it (older ones, e.g. the 5.6 floor, do not)."""
    takes_batch = "batch_size" in inspect.signature(model._prepare_special_tokens).parameters
    model._prepare_special_tokens(config, has_mask, device=device, **({"batch_size": batch} if takes_batch else {}))


def refuse_unsupported(config, user_set: set, defaults, modes) -> None:
    """InputError (one line) for a setting mmspec's loop does not run (see the module docstring)."""
    mode = config.get_generation_mode()
    names = {modes.BEAM_SEARCH: "num_beams", modes.BEAM_SAMPLE: "num_beams", modes.GROUP_BEAM_SEARCH:
             "num_beam_groups", modes.CONSTRAINED_BEAM_SEARCH: "force_words_ids / constraints",
             modes.CONTRASTIVE_SEARCH: "penalty_alpha", modes.DOLA_GENERATION: "dola_layers",
             modes.ASSISTED_GENERATION: next((n for n in ASSISTED_MODE_SETTINGS if getattr(config, n, None)),
                                             "prompt_lookup_num_tokens")}
    name = names.get(mode, "its settings")
    check(mode != modes.ASSISTED_GENERATION, f"assisted generation ({name}) drafts with transformers' own "
                                             f"candidates; mmspec's drafter is the assistant: unset {name}.")
    check(mode in (modes.GREEDY_SEARCH, modes.SAMPLE),
          f"{mode.value.replace('_', ' ')} ({name}) is not speculative decoding: mmspec verifies one sequence per "
          f"row with greedy decoding or sampling; {'set num_beams=1' if name == 'num_beams' else f'unset {name}'}.")
    for name in ("output_attentions", "output_hidden_states"):
        check(not getattr(config, name), f"{name} is not supported: mmspec's loop returns no per-step {name[7:]}; "
                                         "use model.generate for them.")
    check(config.guidance_scale in (None, 1, 1.0), "guidance_scale is not supported: classifier-free guidance runs "
                                                   "a second model pass per token, which mmspec does not verify.")
    check(not config.token_healing, "token_healing is not supported: it rewrites the prompt with the tokenizer.")
    watermark = config.watermarking_config
    check(watermark is None or type(watermark).__name__ == "WatermarkingConfig",
          f"{type(watermark).__name__} is not supported: its processor keeps state between calls.")
    for name in ASSISTED_SETTINGS:  # (a value the model's own generation config holds is not the user's)
        check(name not in user_set or getattr(config, name, None) in (None, getattr(defaults, name, None)),
              f"{name} is a setting of transformers' assisted generation; mmspec's drafter drafts what budget= and "
              "tree= say (num_speculative_tokens=K: a chain of K every step with budget='fixed'): drop it.")
    for name in LOOP_MECHANICS:
        check(name not in user_set or getattr(config, name, None) == getattr(defaults, name, None),
              f"{name} is a setting of transformers' own decoding loop; mmspec runs its own static KV cache: "
              "drop it.")


def prefix_logits(model, config, processors, ids: torch.Tensor, mask: torch.Tensor | None,
                  prefix_allowed_tokens_fn, user_processors) -> PrefixLogits | None:
    """The target's logits hook for `processors` (transformers' list for the whole batch): the processors up to the
    last one that reads tokens run per prefix group (each group's own list, built by transformers for the group's
    call rows, so per-row state such as repetition_penalty's prompt padding and prefix_allowed_tokens_fn's batch id
    are each member's row's; lists are kept per tuple of rows), the ROWWISE rest on every entry at once. None when
    there is nothing to do."""
    from transformers import LogitsProcessorList

    record = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
    cut = max((i + 1 for i, p in enumerate(processors) if type(p).__name__ not in ROWWISE), default=0)
    tail = LogitsProcessorList(processors[cut:])
    if cut == 0 and not tail and not record:
        return None
    lists: dict[tuple[int, ...], LogitsProcessorList] = {}

    def per_prefix(call_rows: torch.Tensor, prefix: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        key = tuple(call_rows.tolist())
        if key not in lists:
            rows = call_rows.to(ids.device)
            allowed = None if prefix_allowed_tokens_fn is None else (
                lambda member, sent, key=key: prefix_allowed_tokens_fn(key[member], sent))
            kwargs = {} if mask is None else {"attention_mask": mask[rows]}
            built = model._get_logits_processor(config, ids.shape[1], ids[rows], allowed, user_processors,
                                                ids.device, kwargs)
            lists[key] = LogitsProcessorList(built[:cut])
        return lists[key](prefix, scores)

    def rowwise(scores: torch.Tensor) -> torch.Tensor:
        return tail(torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device), scores)

    return PrefixLogits(ids, per_prefix if cut else None, rowwise if tail else None, record=record)


def right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pixel_values, extras: dict
                 ) -> VLMInputs:
    """VLMInputs with every row's real tokens first (input rows may be left- or right-padded; per-token extras
    such as mm_token_type_ids move with their tokens)."""
    check(isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2,
          f"input_ids must be a [B, P] tensor (the processor's output), got {type(input_ids).__name__}.")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()
    check(mask.shape == input_ids.shape, f"attention_mask {list(mask.shape)} must match input_ids "
                                         f"{list(input_ids.shape)}.")
    order = torch.sort(1 - mask, dim=-1, stable=True).indices  # [B, P] real tokens first, in order
    moved = {k: (v.gather(1, order.to(v.device)) if k in PER_TOKEN_INPUTS else v) for k, v in extras.items()}
    return VLMInputs(input_ids.gather(1, order), mask.gather(1, order), pixel_values, moved)


def sequences_tensor(input_ids: torch.Tensor, token_ids: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """transformers' output: input ids as given, then each row's new tokens padded with pad_token_id."""
    width = max((len(row) for row in token_ids), default=0)
    new = torch.full((len(token_ids), width), pad_token_id, dtype=input_ids.dtype)
    for row, ids in enumerate(token_ids):
        new[row, : len(ids)] = torch.tensor(ids, dtype=input_ids.dtype)
    return torch.cat([input_ids.cpu(), new], dim=1)


class StreamerBridge:
    """Feeds a transformers streamer (`put(ids)`, `end()`) from `SpeculativeVLM`'s per-round stream callback:
    the prompt first (streamers skip it with skip_prompt=True), then each round's committed tokens."""

    def __init__(self, streamer, prompt_ids: torch.Tensor) -> None:
        self.streamer = streamer
        streamer.put(prompt_ids.cpu())

    def __call__(self, row: int, text: str, token_ids: list[int]) -> None:
        self.streamer.put(torch.tensor([token_ids]))

    def end(self) -> None:
        self.streamer.end()
