"""Static KV cache: per-row masks, chain rollback, tree-path compaction keeps exactly the accepted entries."""

import pytest
import torch

from mmspec.cache import StaticKVCache
from mmspec.errors import InputError


def filled_cache(lengths, capacity=12, heads=2, dim=3):
    cache = StaticKVCache(num_layers=2, batch_size=len(lengths), num_heads=heads, capacity=capacity, head_dim=dim)
    for layer in range(2):  # entry value = 100 * layer + slot, easy to track
        for buf, sign in ((cache.k, 1), (cache.v, -1)):
            buf[layer] = sign * (100 * layer + torch.arange(capacity).float()).view(1, 1, capacity, 1).expand_as(
                buf[layer]).clone()
    cache.lengths = torch.tensor(lengths)
    return cache


def test_causal_mask_per_row_lengths():
    cache = filled_cache([2, 4])
    slots = cache.slots(3)
    assert slots.tolist() == [[2, 3, 4], [4, 5, 6]]
    mask = cache.attention_mask(slots)
    assert mask[0, 0].nonzero().flatten().tolist() == [0, 1, 2]
    assert mask[0, 2].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert mask[1, 1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_tree_mask_sees_prefix_and_ancestors_only():
    cache = filled_cache([3])
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)  # 0 root, 1 and 2 its children
    mask = cache.attention_mask(cache.slots(3), tree)
    assert mask[0, 1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert mask[0, 2].nonzero().flatten().tolist() == [0, 1, 2, 3, 5]


def test_write_places_entries_at_each_rows_slots():
    cache = StaticKVCache(1, 2, 1, 6, 1)
    cache.lengths = torch.tensor([1, 3])
    k_new = torch.tensor([[7.0, 8.0], [9.0, 10.0]]).view(2, 1, 2, 1)
    cache.write(0, cache.slots(2), k_new, -k_new)
    assert cache.k[0][:, 0, :, 0].tolist() == [[0, 7, 8, 0, 0, 0], [0, 0, 0, 9, 10, 0]]


@pytest.mark.parametrize("rows", ["one row", "expanded"])
def test_shared_slots_write_what_the_scatter_writes(rows):
    """Slots every row shares (one row of slots, or one row expanded: stride 0) go through `index_copy_`; the
    cache holds what the per-row scatter writes, entry for entry."""
    torch.manual_seed(0)
    fast, slow = (StaticKVCache(2, 3, 2, 10, 4) for _ in range(2))
    for cache in (fast, slow):
        cache.lengths = torch.tensor([4, 4, 4])
    k_new, v_new = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    shared = fast.slots(5)[:1]  # [1, 5]
    slots = shared if rows == "one row" else shared.expand(3, 5)
    assert rows == "one row" or slots.stride(0) == 0
    got = fast.write(1, slots, k_new, v_new)
    want = slow.write(1, shared.expand(3, 5).clone(), k_new, v_new)  # a [B, S] tensor with its own rows: scatter
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(fast.k[1], slow.k[1]) and torch.equal(fast.v[1], slow.v[1])
    assert torch.equal(fast.k[1][:, :, 4:9], k_new) and fast.k[0].abs().sum() == 0


def test_commit_chain_keeps_exactly_the_accepted_entries():
    cache = filled_cache([2, 4])
    before = [t.clone() for t in cache.k]
    cache.commit_chain(torch.tensor([3, 1]))
    assert cache.lengths.tolist() == [5, 5]
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k))  # rollback moves nothing
    mask = cache.attention_mask(cache.slots(1))
    assert mask[0, 0, :5].all() and not mask[0, 0, 6:].any()


def test_commit_path_compacts_the_accepted_tree_path():
    cache = filled_cache([2, 3])
    before_k = [t.clone() for t in cache.k]
    path = torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]])  # node offsets inside the new region, root first
    cache.commit_path(path, torch.tensor([3, 2]))
    assert cache.lengths.tolist() == [5, 5]
    for layer in range(2):
        k = cache.k[layer][:, 0, :, 0]
        assert k[0, :5].tolist() == (100 * layer + torch.tensor([0, 1, 2, 4, 7])).tolist()
        assert k[1, :5].tolist() == (100 * layer + torch.tensor([0, 1, 2, 3, 4])).tolist()
        assert torch.equal(cache.v[layer][:, 0, :, 0][0, :5], -k[0, :5])
        assert torch.equal(cache.k[layer][:, :, 5:], before_k[layer][:, :, 5:])  # beyond: untouched


def test_finished_rows_commit_nothing():
    cache = filled_cache([2, 2])
    cache.commit_path(torch.tensor([[0, 3], [0, 1]]), torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [4, 2]
    assert cache.k[0][1, 0, :4, 0].tolist() == [0, 1, 2, 3]


def test_capacity_errors_are_clear():
    cache = filled_cache([10])
    with pytest.raises(InputError, match="KV cache full"):
        cache.check_room(5)
    with pytest.raises(InputError, match="capacity"):
        StaticKVCache(1, 1, 1, 0, 1)


def test_select_rows_drops_finished_rows():
    cache = filled_cache([2, 5, 7])
    cache.select_rows(torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [7, 2] and cache.k[0].shape[0] == 2


def test_grow_keeps_every_entry_and_adds_zeroed_room():
    cache = filled_cache([3, 5], capacity=8)
    before = [t.clone() for t in cache.k + cache.v]
    cache.grow(6)  # no-op: it has the room
    assert cache.capacity == 8
    cache.grow(20)
    assert cache.capacity == 20 and cache.lengths.tolist() == [3, 5]
    for old, new in zip(before, cache.k + cache.v):
        assert new.shape[2] == 20 and torch.equal(new[:, :, :8], old) and not new[:, :, 8:].any()
