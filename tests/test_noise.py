"""Position-keyed randomness (`mmspec.noise`): a number is a function of (row key, token index, purpose, sub-key)
alone; uniforms and exponentials have their laws; keys come from the user's generators (one per row: independent of
the batch) and follow the rows a batch keeps."""

import pytest
import torch

from mmspec.errors import InputError
from mmspec.noise import KeyedNoise, mix32


def test_mix32_is_a_bijection_on_a_sample_and_stays_in_32_bits():
    x = torch.arange(0, 1 << 20, dtype=torch.int64) * 4093  # distinct inputs below 2^32
    y = mix32(x)
    assert int(y.min()) >= 0 and int(y.max()) < (1 << 32)
    assert y.unique().numel() == x.numel()
    top = mix32(torch.tensor([(1 << 32) - 1]))  # the largest input: no int64 overflow
    assert 0 <= int(top) < (1 << 32)


def test_numbers_depend_on_key_index_purpose_and_sub_only():
    noise = KeyedNoise(torch.tensor([5, 7, 5]))
    index = torch.tensor([[0, 1, 2]] * 3)
    u = noise.uniforms(index, "accept")
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])  # same key, same numbers
    assert torch.equal(u[:, 1:], noise.uniforms(index[:, 1:], "accept"))  # index 1 is index 1, whatever came before
    assert not torch.equal(u, noise.uniforms(index, "sample"))
    assert not torch.equal(u, noise.uniforms(index, "accept", sub=3))
    e = noise.exponentials(index, "sample", 11)
    assert e.shape == (3, 3, 11) and torch.equal(e[0], e[2]) and torch.equal(e[:, 2], noise.exponentials(
        index[:, 2:], "sample", 11)[:, 0])
    with pytest.raises(InputError, match="purpose must be one of"):
        noise.uniforms(index, "nope")


def test_uniforms_and_exponentials_have_their_laws():
    noise = KeyedNoise(torch.arange(400))
    u = noise.uniforms(torch.arange(500).expand(400, -1), "accept").flatten()  # 200,000
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.004 and abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u.float(), 10, 0, 1)
    assert float((counts / counts.mean() - 1).abs().max()) < 0.03
    e = noise.exponentials(torch.arange(50).expand(400, -1), "sample", 10).flatten()  # 200,000 Exp(1)
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.03 and float(e.min()) > 0
    other = noise.uniforms(torch.arange(500).expand(400, -1), "sample").flatten()
    assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.01  # purposes are independent


def test_keys_come_from_the_generators_and_follow_the_rows():
    per_row = KeyedNoise.from_generators([torch.Generator().manual_seed(s) for s in (3, 4, 5)], 3)
    alone = KeyedNoise.from_generators([torch.Generator().manual_seed(4)], 1)
    assert int(per_row.keys[1]) == int(alone.keys[0])  # a row's key ignores its batch
    one = KeyedNoise.from_generators(torch.Generator().manual_seed(0), 3)
    assert torch.equal(one.keys, KeyedNoise.from_generators(torch.Generator().manual_seed(0), 3).keys)
    assert one.keys.unique().numel() == 3
    kept = per_row.select_rows(torch.tensor([2, 0]))
    assert kept.keys.tolist() == [int(per_row.keys[2]), int(per_row.keys[0])]
    with pytest.raises(InputError, match="got 2 generators for a batch of 3 rows"):
        KeyedNoise.from_generators([torch.Generator(), torch.Generator()], 3)
    for wrong in ("0", [torch.Generator(), None], 7):  # one line, not an AttributeError from deep inside
        with pytest.raises(InputError, match="generator must be a torch.Generator, a list of them"):
            KeyedNoise.from_generators(wrong, 2)


def test_the_numbers_are_pinned_across_versions():
    """A seeded call's numbers are part of what a release keeps (a job resumed by a later version, a figure re-run):
    a change of the hash fails here."""
    noise = KeyedNoise(torch.tensor([12345, 2 ** 61 + 7]))
    index = torch.tensor([[0, 3], [1, 2]])
    assert noise.uniforms(index, "accept").tolist() == [[0.3474689131137399, 0.844683884908751],
                                                        [0.7993531546108232, 0.7060541819505581]]
    assert noise.uniforms(index, "couple", sub=torch.tensor([[1, 2], [3, 4]])).tolist() == [
        [0.31186229706272234, 0.7136651694868485], [0.9509894097070948, 0.050268946566892236]]
    assert noise.exponentials(index[:, :1], "sample", 3).tolist() == [
        [[0.3165490895727079, 0.7471967207886474, 1.5390797979924626]],
        [[2.098227632157229, 1.4616096048143752, 2.2765560521649753]]]
    assert torch.equal(noise.uniforms(index, "accept", sub=5), noise.uniforms(index, "accept", torch.full((2, 2), 5)))


def test_keyed_randomness_hashes_its_uniforms_at_the_first_read_only():
    """`Randomness.keyed`: the acceptance uniforms of a chain (index positions + j) and a tree (positions + depth - 1,
    the node id as sub-key) are the keyed ones, computed when a rule reads them (a coupled rule reads none);
    `from_second` drops each row's first uniform, read or not."""
    from mmspec.tree import chain_as_tree
    from mmspec.verify import ChainDraft
    from mmspec.verify.base import Randomness

    noise = KeyedNoise(torch.tensor([3, 9]))
    positions = torch.tensor([4, 10])
    rand = Randomness.keyed(noise, positions, ChainDraft(torch.zeros(2, 3, dtype=torch.long)), 7)
    assert rand.given_uniforms is None
    expected = noise.uniforms(positions.unsqueeze(-1) + torch.arange(3), "accept")
    assert torch.equal(rand.from_second().uniforms, expected[:, 1:]) and rand.given_uniforms is None
    assert torch.equal(rand.uniforms, expected) and torch.equal(rand.from_second().uniforms, expected[:, 1:])
    tree = chain_as_tree(torch.ones(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    keyed = Randomness.keyed(noise, positions, tree, 7)
    depth_index = positions.unsqueeze(-1) + tree.depths - 1
    assert torch.equal(keyed.uniforms, noise.uniforms(depth_index, "accept", torch.arange(4).expand(2, 4)))
    empty = Randomness.keyed(noise, positions, ChainDraft(torch.zeros(2, 0, dtype=torch.long)), 7)
    assert empty.uniforms.shape == (2, 0) and empty.uniforms.dtype == torch.float64
