"""Prompt lookup (`mmspec.lookup`, the VLM's `pld` kind in `vlm.lookup`): the n-gram match (longest first, most
recent occurrence, never past the row's end), banned tokens, ragged rows after the loop drops finished ones, and
its settings refused in one line. (Exactness and the sampled law on the toy LM and the LLaVA: the method contract,
tests/test_contract.py.)"""

import numpy as np
import pytest
import torch

from mmspec.errors import InputError
from mmspec.lookup import PromptLookupDrafter, cut_at_banned, lookup_continuation, prompt_rows
from mmspec.loop import DecodeState
from vlm.lookup import vision_token_ids


def test_the_longest_recent_ngram_gives_what_followed_it():
    context = np.array([5, 6, 7, 1, 2, 5, 6, 8, 9, 5, 6])
    assert lookup_continuation(context, 3, 1, 4).tolist() == [8, 9, 5, 6]  # "5 6" last seen before 8
    assert lookup_continuation(context, 3, 1, 2).tolist() == [8, 9]
    assert lookup_continuation(np.array([1, 2, 3, 4]), 3, 1, 4).tolist() == []  # nothing recurs
    three = np.array([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])  # "1 2 3" recurs (-> 9) though "2 3" is more recent (-> 7)
    assert lookup_continuation(three, 3, 1, 1).tolist() == [9]
    assert lookup_continuation(three, 2, 1, 1).tolist() == [7]
    assert lookup_continuation(np.array([4, 4]), 3, 1, 3).tolist() == [4]  # a match never reads past the end


def test_drafts_stop_before_banned_tokens_and_prompts_drop_their_padding():
    assert cut_at_banned(np.array([3, 4, 32, 5]), np.array([32])).tolist() == [3, 4]
    assert cut_at_banned(np.array([3, 4]), np.array([], dtype=np.int64)).tolist() == [3, 4]

    class Inputs:
        input_ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
        attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    assert [r.tolist() for r in prompt_rows(Inputs())] == [[1, 2, 3], [4, 5]]
    assert [r.tolist() for r in prompt_rows(torch.tensor([[7, 8]]))] == [[7, 8]]


def test_ragged_rows_draft_their_own_matches_and_follow_dropped_rows():
    drafter = PromptLookupDrafter(num_draft_tokens=4, max_ngram=2, banned_tokens=[32])
    assert drafter.draft_sizes == [0, 1, 2, 4] and drafter.max_draft_nodes == 5
    prompts = torch.tensor([[9, 1, 2, 3, 4, 0], [9, 5, 6, 32, 7, 0], [8, 8, 8, 8, 8, 8]])
    state = DecodeState.new(3, 6, "cpu")
    drafter.begin(prompts, state)
    state.output[:, 0] = torch.tensor([1, 5, 3])  # each row's first generated token
    state.num_generated[:] = 1
    draft = drafter.propose(state)  # row 0: "1" -> 2 3 4 0; row 1: "5" -> 6, stopped before 32; row 2: nothing
    assert draft.num_draft.tolist() == [4, 1, 0] and draft.tokens[0].tolist() == [2, 3, 4, 0]
    assert draft.tokens[1, 0] == 6 and draft.probs is None
    state.select_rows(torch.tensor([1]))  # the loop dropped rows 0 and 2: row 1's prompt still answers
    drafter.select_rows(torch.tensor([1]))
    assert drafter.propose(state).tokens[0].tolist() == [6]
    drafter.set_draft_size(1)
    assert drafter.propose(state).tokens.shape == (1, 1)


def test_settings_are_checked_and_the_vlm_bans_its_vision_tokens():
    with pytest.raises(InputError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(InputError, match="num_draft_tokens"):
        PromptLookupDrafter(num_draft_tokens=0)

    class Config:
        image_token_id, video_token_id, vision_start_token_id, hidden_size = 151655, 151656, 151652, 8

    assert vision_token_ids(Config()) == [151652, 151655, 151656]
    from transformers import Gemma3Config, LlavaOnevisionConfig, Qwen2_5_VLConfig

    assert vision_token_ids(LlavaOnevisionConfig()) == [151646, 151647]  # <image> and <video>
    assert vision_token_ids(Qwen2_5_VLConfig()) == [151652, 151653, 151655, 151656]
    assert vision_token_ids(Gemma3Config()) == [255999, 256000, 262144]


def test_the_pld_kind_needs_no_folder_and_refuses_trees(tmp_path):
    from vlm.family import DRAFTER_KINDS, TRAINING_FREE_KINDS, drafter_kinds_in
    from vlm.lookup import VLMPromptLookup

    assert "pld" in TRAINING_FREE_KINDS and "pld" not in DRAFTER_KINDS and drafter_kinds_in(tmp_path) == []
    with pytest.raises(InputError, match="drafts chains"):
        VLMPromptLookup.loop_drafter(VLMPromptLookup(), None, None, top_k=4, depth=3, total_tokens=8)
    chain = VLMPromptLookup.loop_drafter(VLMPromptLookup(num_draft_tokens=10), None, None, top_k=1, depth=3)
    assert chain.k == 3


def brute_force_repeat(tokens: list[int], min_length: int) -> int:
    """The first earlier end of the longest suffix of `tokens` that occurred before the end, by scanning."""
    n = len(tokens)
    for length in range(n - 1, min_length - 1, -1):
        suffix = tokens[n - length:]
        for end in range(length - 1, n - 1):
            if tokens[end - length + 1: end + 1] == suffix:
                return end
    return -1


def test_the_suffix_automaton_finds_the_longest_repeated_suffix_as_a_scan_does():
    from mmspec.lookup import SuffixAutomaton

    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        tokens = torch.randint(0, 2 + trial % 4, (30,), generator=generator).tolist()
        automaton = SuffixAutomaton()
        for i, token in enumerate(tokens):
            automaton.extend(token)
            for min_length in (1, 2):
                assert automaton.repeat(min_length) == brute_force_repeat(tokens[: i + 1], min_length), (trial, i)


def test_the_suffix_lookup_drafts_what_followed_the_longest_repeat_and_follows_dropped_rows():
    from mmspec.lookup import SuffixLookupDrafter

    drafter = SuffixLookupDrafter(num_draft_tokens=3, banned_tokens=[32])
    prompts = torch.tensor([[9, 1, 2, 3, 4, 5, 1, 2], [7, 7, 6, 32, 8, 0, 0, 0]])
    state = DecodeState.new(2, 6, "cpu")
    drafter.begin(prompts, state)
    state.output[:, :2] = torch.tensor([[3, 4], [7, 6]])
    state.num_generated[:] = 2
    draft = drafter.propose(state)  # row 0: "1 2 3 4" repeats -> 5 1 2; row 1: "7 6" -> stopped before 32
    assert draft.tokens[0].tolist() == [5, 1, 2] and draft.num_draft.tolist() == [3, 0]
    state.select_rows(torch.tensor([0]))
    drafter.select_rows(torch.tensor([0]))
    state.output[0, 2], state.num_generated[0] = 5, 3
    assert drafter.propose(state).tokens[0].tolist() == [1, 2, 3]  # "3 4 5" repeats too: what followed its first
