"""`mmspec.prefixes`: every verified entry is processed on its own prefix (a tree node's path, not its siblings'),
rows dropped from the batch keep their call row's prompt, and a row ends at the first committed token a criterion
holds after."""

from __future__ import annotations

import torch

from mmspec.prefixes import PrefixLogits, first_stops, verified_entries
from mmspec.tree import DraftTree
from mmspec.verify import ChainDraft

PROMPTS = torch.tensor([[100, 101], [200, 201], [300, 301]])  # [B0, P] call rows' prompts


def echo_prefix(call_rows, ids, scores):
    """Writes each member's prefix into its scores: entry [v] = ids[v] (-2 past the prefix), so a test can read what
    the function saw."""
    out = torch.full_like(scores, -2.0)
    out[:, : ids.shape[1]] = ids.float()
    return out


def seen(processed: torch.Tensor, row: int, entry: int) -> list[int]:
    values = processed[row, entry]
    return [int(v) for v in values[values != -2]]


def test_tree_nodes_see_their_own_paths():
    generated = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1]])  # [B, T], counts 2 and 1
    counts = torch.tensor([2, 1])
    # row 0: root 0, children 1 (tok 11) and 2 (tok 12), grandchild 3 (tok 13) under 1; row 1: a chain of 2
    tree = DraftTree(tokens=torch.tensor([[6, 11, 12, 13], [7, 21, 22, -1]]),
                     parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]]),
                     depths=torch.tensor([[0, 1, 1, 2], [0, 1, 2, 0]]),
                     valid=torch.tensor([[True] * 4, [True, True, True, False]]), max_depth=2, max_children=2)
    hook = PrefixLogits(PROMPTS, echo_prefix)
    processed = hook(torch.zeros(2, 4, 16), generated, counts, tree, row_ids=torch.tensor([0, 2]))
    assert seen(processed, 0, 0) == [100, 101, 5, 6]
    assert seen(processed, 0, 1) == [100, 101, 5, 6, 11]
    assert seen(processed, 0, 2) == [100, 101, 5, 6, 12]  # not its sibling's token
    assert seen(processed, 0, 3) == [100, 101, 5, 6, 11, 13]
    assert seen(processed, 1, 2) == [300, 301, 7, 21, 22]  # held row 1 is call row 2
    assert torch.equal(processed[1, 3], torch.zeros(16))  # a padding node keeps its logits
    entries = verified_entries(generated, counts, tree, None)
    assert entries.lengths.tolist() == [2, 3, 3, 4, 1, 2, 3]


def test_chain_entries_and_the_prefill():
    generated = torch.tensor([[5, -1, -1]])
    chain = ChainDraft(torch.tensor([[8, 9, -1]]), num_draft=torch.tensor([2]))
    processed = PrefixLogits(PROMPTS, echo_prefix)(torch.zeros(1, 4, 16), generated, torch.tensor([1]), chain, None)
    assert [seen(processed, 0, j) for j in range(3)] == [[100, 101, 5], [100, 101, 5, 8], [100, 101, 5, 8, 9]]
    assert torch.equal(processed[0, 3], torch.zeros(16))  # past num_draft
    first = PrefixLogits(PROMPTS, echo_prefix, rowwise=lambda s: s + 1000)(
        torch.zeros(3, 1, 16), torch.empty(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), None, None)
    assert [seen(first - 1000, r, 0) for r in range(3)] == [[100, 101], [200, 201], [300, 301]]


def test_a_row_ends_at_the_first_token_its_criterion_holds_after():
    generated = torch.tensor([[5, 6, 7, 8, -1], [5, 9, 9, -1, -1], [4, 4, -1, -1, -1]])
    before, after = torch.tensor([1, 1, 1]), torch.tensor([4, 3, 2])

    def ends_on_nine_or_seven(call_rows, ids):
        return (ids[:, -1] == 9) | ((ids[:, -1] == 7) & (call_rows == 0))

    ends = first_stops(ends_on_nine_or_seven, PROMPTS, generated, before, after, None)
    assert ends.tolist() == [3, 2, -1]  # row 0 after its token 2 (a 7), row 1 after its first 9, row 2 never
    nothing = first_stops(ends_on_nine_or_seven, PROMPTS, generated, after, after, None)
    assert nothing.tolist() == [-1, -1, -1]
