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
