"""Every `generate` setting of transformers on `SpeculativeVLM.generate(**processor_outputs)`: a matrix of calls
(greedy and sampled, batch 1 and a left-padded batch of 3, LLaVA and Qwen2-VL, each drafter kind, budget "auto" and
"fixed") equals `model.generate` token for token at greedy and in law when sampling (pooled chi-square with a
negative control); refused settings are one line, before the model runs."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from mmspec.errors import InputError
from mmspec.testing.distributions import pooled_chi_square, prefix_pairs
from vlm.family import TRAINING_FREE_KINDS, drafter_model, training_free_drafter
from vlm.hf_generate import PER_TOKEN_INPUTS, prepare_special_tokens
from vlm.tiny import tiny_processor_batch, tiny_vlm

NEW = 12


@pytest.fixture(scope="module")
def vlms():
    return {family: tiny_vlm(family) for family in ("llava", "qwen2_vl")}


def with_drafter(vlm, kind: str | None):
    if kind in TRAINING_FREE_KINDS:
        vlm.drafter = training_free_drafter(kind).eval().attach(vlm.lm)
    else:
        vlm.drafter = None if kind is None else drafter_model(kind).for_target(vlm.lm).eval().attach(vlm.lm)
    return vlm


def greedy_setting(name: str, base: torch.Tensor, prompt_length: int, pad: int) -> dict:
    """A setting that changes the greedy answers `base` [B, P + NEW] of the tiny model (so the test could fail)."""
    new = base[:, prompt_length:]
    first = int(new[0, 0])  # a token every variant must handle
    repeated = int(new[0, new.shape[1] // 2])
    return {
        "repetition_penalty": {"repetition_penalty": 1.6},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "suppress_tokens": {"suppress_tokens": [first, repeated]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [first]},
        "bad_words_ids": {"bad_words_ids": [[repeated]]},
        "sequence_bias": {"sequence_bias": {(repeated,): -50.0}},
        "eos_token_id_list": {"eos_token_id": [repeated, int(new[-1, -1])], "pad_token_id": pad},
        "min_new_tokens": {"eos_token_id": repeated, "min_new_tokens": 9},
        "max_length": {"max_length": prompt_length + 5, "max_new_tokens": None},
        "generation_config": {"generation_config": GenerationConfig(max_new_tokens=7, repetition_penalty=1.3,
                                                                    eos_token_id=repeated)},
        "exponential_decay": {"eos_token_id": repeated, "exponential_decay_length_penalty": (2, 1.5)},
        "forced_eos": {"forced_eos_token_id": first, "max_new_tokens": 6},
    }[name]


# (family, batch, drafter kind, budget, setting): 27 greedy calls
GREEDY = [
    ("llava", 3, "eagle", "fixed", "repetition_penalty"),
    ("llava", 3, "eagle", "auto", "no_repeat_ngram_size"),
    ("llava", 1, "eagle", "fixed", "suppress_tokens"),
    ("llava", 3, "vispec", "fixed", "bad_words_ids"),
    ("llava", 3, "vispec", "auto", "sequence_bias"),
    ("llava", 3, "msd", "fixed", "eos_token_id_list"),
    ("llava", 1, "msd", "auto", "min_new_tokens"),
    ("llava", 3, "specvlm", "fixed", "max_length"),
    ("llava", 3, "specvlm", "auto", "generation_config"),
    ("llava", 3, None, "fixed", "repetition_penalty"),
    ("llava", 3, "eagle", "fixed", "exponential_decay"),
    ("llava", 3, "msd", "fixed", "forced_eos"),
    ("llava", 3, "eagle", "fixed", "begin_suppress_tokens"),
    ("qwen2_vl", 3, "eagle", "fixed", "no_repeat_ngram_size"),
    ("qwen2_vl", 3, "eagle", "auto", "repetition_penalty"),
    ("qwen2_vl", 1, "vispec", "fixed", "sequence_bias"),
    ("qwen2_vl", 3, "vispec", "auto", "suppress_tokens"),
    ("qwen2_vl", 3, "msd", "fixed", "min_new_tokens"),
    ("qwen2_vl", 3, "msd", "auto", "eos_token_id_list"),
    ("qwen2_vl", 3, "specvlm", "fixed", "bad_words_ids"),
    ("qwen2_vl", 1, "specvlm", "auto", "max_length"),
    ("qwen2_vl", 3, "eagle", "fixed", "generation_config"),
    ("qwen2_vl", 3, "eagle", "fixed", "exponential_decay"),
    ("qwen2_vl", 3, "specvlm", "fixed", "forced_eos"),
    ("llava", 3, "recycle", "auto", "repetition_penalty"),  # the training-free drafters
    ("qwen2_vl", 3, "pld", "fixed", "no_repeat_ngram_size"),
    ("llava", 3, "sam", "fixed", "sequence_bias"),
]


@pytest.mark.parametrize("family,batch,kind,budget,setting", GREEDY)
def test_greedy_calls_equal_model_generate(vlms, family, batch, kind, budget, setting):
    vlm = with_drafter(vlms[family], kind)
    enc = tiny_processor_batch(vlm, n=batch)
    p = enc["input_ids"].shape[1]
    base = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    settings = {"max_new_tokens": NEW, "do_sample": False, **greedy_setting(setting, base, p, pad=7)}
    settings = {k: v for k, v in settings.items() if v is not None}
    reference = vlm.model.generate(**enc, **settings)
    assert not torch.equal(reference, base) or setting in ("begin_suppress_tokens", "exponential_decay")
    assert torch.equal(vlm.generate(**enc, budget=budget, **settings), reference)
    if kind is not None and budget == "fixed":
        assert vlm.last_stats.num_drafts > 0


def test_begin_suppress_and_exponential_decay_change_the_answers(vlms):
    """The two settings the matrix may leave unchanged do change answers when they bite."""
    vlm = with_drafter(vlms["llava"], "eagle")
    enc = tiny_processor_batch(vlm, n=3)
    p = enc["input_ids"].shape[1]
    base = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    first = sorted({int(t) for t in base[:, p]})
    for settings in ({"begin_suppress_tokens": first},
                     {"eos_token_id": int(base[0, p + 3]), "exponential_decay_length_penalty": (1, 3.0)}):
        reference = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False, **settings)
        assert not torch.equal(reference, base)
        assert torch.equal(vlm.generate(**enc, max_new_tokens=NEW, do_sample=False, budget="fixed", **settings),
                           reference)


class BanOddAfterEven(LogitsProcessor):
    """A user's processor that reads the prefix: after an even token, odd tokens are banned."""

    def __call__(self, input_ids, scores):
        odd = torch.arange(scores.shape[-1], device=scores.device) % 2 == 1
        even_last = (input_ids[:, -1] % 2 == 0).unsqueeze(-1)
        return scores.masked_fill(even_last & odd, float("-inf"))


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_users_processors_criteria_stop_strings_and_prefix_functions(vlms, family):
    vlm = with_drafter(vlms[family], "eagle")
    enc = tiny_processor_batch(vlm, n=3)
    p = enc["input_ids"].shape[1]
    tok = vlm.processor.tokenizer
    base = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    row_text = tok.decode(base[1, p:], skip_special_tokens=True)
    allowed = {row: sorted({int(t) for t in base[row, p:]})[:3] + [row + 20] for row in range(3)}
    calls = [
        {"logits_processor": LogitsProcessorList([BanOddAfterEven()])},
        {"stopping_criteria": StoppingCriteriaList([StopAfterToken(int(base[1, p + 4]))])},
        {"stop_strings": [row_text.strip()[3:5] or row_text.strip()[:1]], "tokenizer": tok},
        {"prefix_allowed_tokens_fn": lambda batch_id, ids: allowed[batch_id]},  # reads the row's batch id
        {"max_time": 0.0},  # out of time after the first token
        {"use_cache": False, "repetition_penalty": 1.4},  # (the same tokens with the cache, as in transformers)
    ]
    for settings in calls:
        reference = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False, **settings)
        assert not torch.equal(reference, base), settings
        assert torch.equal(vlm.generate(**enc, max_new_tokens=NEW, do_sample=False, budget="fixed", **settings),
                           reference), settings


def test_stop_strings_without_a_tokenizer_use_the_processors(vlms):
    vlm = with_drafter(vlms["llava"], "msd")
    enc = tiny_processor_batch(vlm, n=1)
    p = enc["input_ids"].shape[1]
    base = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    stop = vlm.processor.tokenizer.decode(base[0, p + 2: p + 4])
    out = vlm.generate(**enc, max_new_tokens=NEW, do_sample=False, stop_strings=[stop], budget="fixed")
    assert torch.equal(out, vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False, stop_strings=[stop],
                                               tokenizer=vlm.processor.tokenizer))
    assert out.shape[1] < base.shape[1]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_scores_and_logits_are_generates(vlms, family):
    vlm = with_drafter(vlms[family], "vispec")
    enc = tiny_processor_batch(vlm, n=3)
    p = enc["input_ids"].shape[1]
    base = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    settings = dict(max_new_tokens=NEW, do_sample=False, repetition_penalty=1.3, eos_token_id=int(base[0, p + 5]),
                    return_dict_in_generate=True, output_scores=True, output_logits=True)
    reference = vlm.model.generate(**enc, **settings)
    out = vlm.generate(**enc, budget="fixed", **settings)
    assert type(out) is type(reference) and torch.equal(out.sequences, reference.sequences)
    assert len(out.scores) == len(reference.scores) == len(out.logits)
    ended = (reference.sequences[:, p:] == settings["eos_token_id"]).int().cumsum(-1)  # [B, N] > 0 after the end
    for t, (ours, theirs, raw, raw_ref) in enumerate(zip(out.scores, reference.scores, out.logits,
                                                         reference.logits)):
        live = (ended[:, t] - (reference.sequences[:, p + t] == settings["eos_token_id"]).int()) == 0
        assert torch.allclose(ours[live], theirs[live], atol=1e-4, rtol=1e-4)
        assert torch.allclose(raw[live], raw_ref[live], atol=1e-4, rtol=1e-4)
        assert not ours[~live].any()  # zeros after a row's end
    assert vlm.generate(**enc, budget="fixed", max_new_tokens=4, return_dict_in_generate=True).scores is None


def processed_law(vlm, enc, settings: dict, prefix: tuple) -> torch.Tensor:
    """transformers' sampling law [V] of the token after prompt + `prefix` under `settings` (its own processors)."""
    model = vlm.model
    config, _ = model._prepare_generation_config(None, **settings)
    prepare_special_tokens(model, config, True, "cpu", 1)
    new = torch.tensor([prefix], dtype=torch.long)
    ids = torch.cat([enc["input_ids"], new], dim=1)
    inputs = {k: (torch.cat([v, torch.zeros_like(new)], 1) if k in PER_TOKEN_INPUTS else v)
              for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    processors = model._get_logits_processor(config, enc["input_ids"].shape[1], enc["input_ids"], None, None, "cpu",
                                             {"attention_mask": enc["attention_mask"]})
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[:, -1].float()
    return torch.softmax(processors(ids, logits), dim=-1)[0]


# (family, drafter kind, accept, rows, settings that read the prefix, the rest): one prompt repeated, checked in law
# against transformers' processed law, and against the law without the prefix-reading settings (negative control)
SAMPLED = [
    ("llava", "eagle", "coupled", 400, {"repetition_penalty": 3.0}, {}),
    ("llava", "msd", "lossless", 400, {"no_repeat_ngram_size": 1}, {"min_p": 0.01}),
    ("qwen2_vl", "vispec", "coupled", 800, {"no_repeat_ngram_size": 1}, {}),
    ("qwen2_vl", "specvlm", "lossless", 800, {"repetition_penalty": 10.0}, {"top_p": 0.95, "typical_p": 0.99}),
]


@pytest.mark.parametrize("family,kind,accept,rows,reading,rest", SAMPLED)
def test_sampled_calls_follow_the_processed_law(vlms, family, kind, accept, rows, reading, rest):
    from scipy import stats

    vlm = with_drafter(vlms[family], kind)
    enc = tiny_processor_batch(vlm, n=1)
    p = enc["input_ids"].shape[1]
    control = {"do_sample": True, "top_k": 5, **rest}  # top-k 5: enough samples per prefix for the test
    settings = {**control, **reading}
    out = vlm.generate(**enc, max_new_tokens=3, num_return_sequences=rows, budget="fixed", accept=accept,
                       generator=torch.Generator().manual_seed(0), **settings)
    assert out.shape[0] == rows and vlm.last_stats.num_drafts > 0
    pairs = prefix_pairs(out[:, p:].tolist(), [1, 2])
    chi2, dof = pooled_chi_square(pairs, lambda prefix: processed_law(vlm, enc, settings, prefix))
    assert dof >= 20 and stats.chi2.sf(chi2, dof) > 1e-3, (chi2, dof)
    chi2, dof = pooled_chi_square(pairs, lambda prefix: processed_law(vlm, enc, control, prefix))
    assert stats.chi2.sf(chi2, dof) < 1e-3, ("the negative control passed", chi2, dof)


def test_the_models_own_assisted_generation_defaults_are_not_refused(vlms):
    """A generation config copied from the model's (which may hold num_assistant_tokens) runs; the user's own value
    is refused."""
    import copy

    vlm = with_drafter(vlms["llava"], "eagle")
    enc = tiny_processor_batch(vlm, n=1)
    saved = copy.deepcopy(vlm.model.generation_config)
    try:
        vlm.model.generation_config.num_assistant_tokens = 5
        config = copy.deepcopy(vlm.model.generation_config)
        assert vlm.generate(**enc, generation_config=config, max_new_tokens=3, do_sample=False).shape[0] == 1
        with pytest.raises(InputError, match="num_assistant_tokens"):
            vlm.generate(**enc, num_assistant_tokens=3, max_new_tokens=3)
    finally:
        vlm.model.generation_config = saved


def test_num_return_sequences_and_pad_token_id(vlms):
    vlm = with_drafter(vlms["llava"], "eagle")
    enc = tiny_processor_batch(vlm, n=2)
    p = enc["input_ids"].shape[1]
    out = vlm.generate(**enc, max_new_tokens=5, do_sample=True, num_return_sequences=3, budget="fixed",
                       generator=torch.Generator().manual_seed(1))
    assert out.shape[0] == 6 and torch.equal(out[:3, :p], enc["input_ids"][[0, 0, 0]])
    base = vlm.model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    settings = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=int(base[0, p + 2]), pad_token_id=11)
    reference = vlm.model.generate(**enc, **settings)
    assert (reference[0, p + 3:] == 11).all()
    assert torch.equal(vlm.generate(**enc, budget="fixed", **settings), reference)


@pytest.mark.parametrize("settings,message", [
    ({"num_beams": 4}, "beam search.*num_beams"),
    ({"generation_config": GenerationConfig(num_beams=2, do_sample=True)}, "beam sample"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search"),
    ({"prompt_lookup_num_tokens": 3}, "assisted generation"),
    ({"assistant_early_exit": 2}, "assisted generation .assistant_early_exit.*unset assistant_early_exit"),
    ({"num_assistant_tokens": 3}, "num_assistant_tokens is a setting of transformers' assisted generation"),
    ({"generation_config": GenerationConfig(assistant_ensemble_weight=0.5)}, "assistant_ensemble_weight"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
    ({"output_hidden_states": True}, "output_hidden_states"),
    ({"guidance_scale": 1.5}, "guidance_scale"),
    ({"cache_implementation": "static"}, "cache_implementation"),
    ({"compile_config": object()}, "compile_config|GenerationConfig"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"assistant_model": object()}, "assistant_model"),
    ({"negative_prompt_ids": torch.ones(1, 3, dtype=torch.long)}, "negative_prompt_ids"),
    ({"custom_generate": "x/y"}, "custom_generate"),
    ({"synced_gpus": True}, "synced_gpus"),
    ({"inputs_embeds": torch.zeros(2, 3, 4)}, "inputs_embeds"),
    ({"made_up_setting": 3}, "made_up_setting"),
    ({"vision_feature_layer": -2}, "not tensors"),
    ({"stop_strings": ["x"], "eos_token_id": None, "pad_token_id": 0}, "need an eos_token_id"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"generation_config": {"do_sample": True}}, "must be a transformers GenerationConfig"),
])
def test_refused_settings_are_one_line_before_the_model_runs(vlms, settings, message):
    vlm = with_drafter(vlms["llava"], "eagle")
    enc = tiny_processor_batch(vlm, n=2)
    calls = []  # any module's forward, the vision tower's included
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(InputError, match=message) as err:
            vlm.generate(**enc, max_new_tokens=settings.pop("max_new_tokens", 4), **settings)
    finally:
        handle.remove()
    assert "\n" not in str(err.value) and not calls
