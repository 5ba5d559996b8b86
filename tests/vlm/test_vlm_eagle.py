"""EagleVLM (`vlm.eagle`): the drafter's cached path equals its training forward over the true pairs, and EAGLE-2
tree drafting through the core loop is lossless: greedy speculative == greedy vanilla, token for token, for
ragged batches, with an untrained drafter (low acceptance) and with a drafter that copies the target."""

from __future__ import annotations

import pytest
import torch
from vlm_dummies import batch, prompt, tiny_llava

from mmspec.lm import LMTarget, NoDrafter
from mmspec.loop import generate
from mmspec.sampling import SamplingParams
from vlm.eagle import VLMEagleDrafter, VLMEagleTreeDrafter
from vlm.target import LlavaCachedLM, prefill_vlm

ROWS = [prompt([7, 8, 20], [9], 16), prompt([12], [13, 30, 31, 32], 16), prompt([], [5], 16)]


def run(model, rows, pixels, steps, drafter=None, **tree):
    lm = LlavaCachedLM(model)
    target = LMTarget(lm, SamplingParams(temperature=0.0), max_new_tokens=steps, prefill_fn=prefill_vlm)
    loop_drafter = NoDrafter() if drafter is None else VLMEagleTreeDrafter(drafter.attach(lm), lm,
                                                                          SamplingParams(temperature=0.0), **tree)
    return generate(target, loop_drafter, "lossless", batch(rows, pixels), batch_size=len(rows),
                    max_new_tokens=steps)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_eagle_equals_greedy_vanilla(batch_size):
    model = tiny_llava(seed=5)
    rows, pixels = ROWS[:batch_size], torch.rand(batch_size, 3, 32, 32)
    torch.manual_seed(0)
    drafter = VLMEagleDrafter.for_target(LlavaCachedLM(model))
    vanilla = run(model, rows, pixels, 12)
    spec = run(model, rows, pixels, 12, drafter, top_k=3, depth=3, total_tokens=8)
    assert torch.equal(spec.tokens, vanilla.tokens)
    assert spec.stats.num_drafts > 0 and spec.stats.num_draft_forwards > 0


class OracleTreeDrafter(VLMEagleTreeDrafter):
    """Scores tree candidates with the known greedy continuation (the drafter model still runs its pending pairs),
    so whole branches are accepted: exercises the target's tree verification and cache compaction on long
    accepted paths."""

    answer: torch.Tensor  # [B, steps] the vanilla greedy tokens

    def propose(self, state):
        from mmspec.tree import expand_eagle2

        self.run_pending()
        steps = self.answer.shape[1]

        def score(tokens, ids, parent_ids, depth):
            index = (state.num_generated + depth).clamp_max(steps - 1)  # [B] the token after this depth
            logits = torch.zeros(ids.shape[0], ids.shape[1], self.model.vocab_size)
            logits[torch.arange(ids.shape[0]), :, self.answer.gather(1, index[:, None])[:, 0]] = 10.0
            return torch.log_softmax(logits, -1)

        return expand_eagle2(state.last_token, score, top_k=self.top_k, depth=self.depth, total_tokens=self.total)


def test_long_accepted_tree_paths_keep_the_target_exact():
    model = tiny_llava(seed=5)
    pixels = torch.rand(3, 3, 32, 32)
    vanilla = run(model, ROWS, pixels, 16)
    lm = LlavaCachedLM(model)
    drafter = OracleTreeDrafter(VLMEagleDrafter.for_target(lm), lm, SamplingParams(temperature=0.0), top_k=2,
                                depth=4, total_tokens=8)
    drafter.answer = vanilla.tokens
    target = LMTarget(lm, SamplingParams(temperature=0.0), max_new_tokens=16, prefill_fn=prefill_vlm)
    spec = generate(target, drafter, "lossless", batch(ROWS, pixels), batch_size=3, max_new_tokens=16)
    assert torch.equal(spec.tokens, vanilla.tokens)
    assert spec.stats.mean_acceptance_length > 4.0  # depth 4 + bonus, capped near the end
    assert spec.stats.num_target_forwards <= 1 + 4  # prefill + ceil(15 / 5) rounds (+1 slack)


def test_cached_drafter_equals_its_training_forward():
    model = tiny_llava(seed=2)
    lm = LlavaCachedLM(model)
    drafter = VLMEagleDrafter.for_target(lm)
    rows, pixels = ROWS[:2], torch.rand(2, 3, 32, 32)
    target = LMTarget(lm, SamplingParams(temperature=0.0), max_new_tokens=4, prefill_fn=prefill_vlm)
    target.prefill(batch(rows, pixels))
    features, embeds = lm.last_hidden, lm.prompt_embeds  # [2, P, H]
    tree = VLMEagleTreeDrafter(drafter, lm, SamplingParams(temperature=0.0), top_k=2, depth=2, total_tokens=4)
    from mmspec.loop import DecodeState

    state = DecodeState.new(2, 4, "cpu")
    state.last_token = torch.tensor([40, 41])
    tree.begin(batch(rows, pixels), state)
    _, root_hidden, root_slot = tree.run_pending()
    for b, r in enumerate(rows):
        n = len(r)
        pair_embeds = torch.cat([embeds[b: b + 1, 1:n], lm.text.embed_tokens(state.last_token[b: b + 1])[:, None]], 1)
        with torch.no_grad():
            reference = drafter(pair_embeds, features[b: b + 1, :n])  # [1, n, H]
        assert int(root_slot[b]) == n - 1
        torch.testing.assert_close(root_hidden[b], reference[0, -1], atol=1e-5, rtol=1e-5)


def test_a_call_drafting_chains_allocates_no_candidate_pool():
    """The drafter cache holds the pending pairs and a chain of the deepest depth a budget may draft; a tree's
    candidate pool is added when a tree is drafted, whatever the drafter was set to at `begin`."""
    from mmspec.loop import DecodeState
    from mmspec.tree import TreeShape, max_chain_depth, pool_size

    model = tiny_llava(seed=5)
    lm = LlavaCachedLM(model)
    drafter = VLMEagleDrafter.for_target(lm)
    rows, pixels = ROWS[:2], torch.rand(2, 3, 32, 32)
    tree = VLMEagleTreeDrafter(drafter, lm, SamplingParams(temperature=0.0), top_k=4, depth=4, total_tokens=16)
    target = LMTarget(lm, SamplingParams(temperature=0.0), max_new_tokens=4, prefill_fn=prefill_vlm)

    def begin() -> DecodeState:
        target.prefill(batch(rows, pixels))
        state = DecodeState.new(2, 4, "cpu")
        tree.begin(batch(rows, pixels), state)
        return state

    chain_room = max_chain_depth(tree.full_shape) + 1
    tree.set_draft_size(TreeShape(1, 3, 4))
    state = begin()
    assert tree.runner.cache.capacity == tree.room_base + chain_room < tree.room_base + pool_size(4, 4)
    assert tree.propose(state).num_nodes == 4
    tree.set_draft_size(tree.full_shape)
    assert tree.propose(state).num_nodes == 16 and tree.runner.cache.capacity == tree.room_base + pool_size(4, 4)
    state = begin()  # set to the tree: chains' room until it drafts one
    assert tree.runner.cache.capacity == tree.room_base + chain_room
    assert tree.propose(state).num_nodes == 16 and tree.runner.cache.capacity == tree.room_base + pool_size(4, 4)
