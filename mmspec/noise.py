"""Position-keyed randomness: every random number of a sampled call is a function of (row key, token index, purpose,
sub-key), never of how many numbers were drawn before it.

    noise = KeyedNoise.from_generators(generators, batch, device)   # one key per row, drawn once per call
    u = noise.uniforms(index, "accept")                              # index [B, K] -> [B, K] float64 in (0, 1)
    e = noise.exponentials(index, "sample", vocab)                   # index [B, K] -> [B, K, V] float64 Exp(1)

A row's key is one draw from its generator at the call's start (one generator per row makes the row independent of
the batch it is in; one generator for the batch draws the keys in row order). From then on the numbers used at
token index t (0-based, of the generated tokens) are fixed by the key and t: the same whatever the drafter, the
draft sizes a budget picks, the rows a batch drops or the machine's load. So a sampled call reproduces exactly from
its seeds, and a rule that emits at every index the exponential race of the target's p under the "sample" noise
(`mmspec.verify.coupled`) emits vanilla's sample, drafts or not.

Each use of a number consumes the index it decides: the loop never decides a token index twice, and numbers drawn
for indices past a step's first rejection decide nothing (they are drawn again, the same, for the next step's drafts
there, whose law does not depend on them). Purposes keep independent uses apart (`PURPOSES`): "sample" the target's
token (the bonus or recovered token, a plain step's token, and, for a coupled rule, the drafts), "accept" the
acceptance uniforms, "draft" a drafter's own samples under a rule that must see them independent of the target's
(`draft_exponentials`), "init" Jacobi's random initialisation, "couple" the keep-or-redraw uniforms of Jacobi's maximal
coupling.

The numbers come from a counter-based hash (a lowbias32 mix of 32-bit words, in int64 tensor arithmetic that never
overflows), so they are the same on every device and need no state: two 32-bit hashes make one 53-bit
uniform (a vocabulary's exponentials use one: `exponentials`). Glossary: B rows, K indices per row, V vocabulary.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from mmspec.errors import check

PURPOSES = {"sample": 0x51ED27, "accept": 0xACCE97, "draft": 0xD2AF75, "init": 0x1217A1, "couple": 0xC0591E}
M32 = 0xFFFFFFFF
HIGH, LOW = 0x68E31DA4, 0xB5297A4D  # the salts of a hash's two output streams (a uniform's high and low bits)
KEY_RANGE = 1 << 62


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mix of int64 x in [0, 2^32) with good avalanche (Wellons' hash-prospector lowbias32
    with constants below 2^31, so every product stays below 2^63 in int64)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


@lru_cache(maxsize=64)
def vocabulary_salts(vocab: int, device: torch.device) -> torch.Tensor:
    """[V] int64: the per-token words mixed into a (row, index) hash, made once per V and device."""
    return mix32((torch.arange(vocab, dtype=torch.int64, device=device) * 2 + 1) & M32)


def to_uniform(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Two 32-bit hashes -> float64 uniforms in (0, 1) with 53 random bits (never 0 or 1)."""
    bits = (high >> 5) * (1 << 26) + (low >> 6)  # 27 + 26 = 53 bits
    return (bits.double() + 0.5) * (2.0 ** -53)


class KeyedNoise:
    """Per-row keys [B] and the numbers they give (see the module docstring). `coupled`: the call's rule compares
    drafts with the target's own sample, so drafters draw with the "sample" noise (`draft_exponentials`)."""

    def __init__(self, keys: torch.Tensor, coupled: bool = False) -> None:
        check(keys.dim() == 1 and keys.dtype == torch.int64, "keys must be a [B] int64 tensor.")
        self.keys = keys  # [B] in [0, 2^62)
        self.coupled = coupled
        self._words = torch.stack([keys & M32, (keys >> 32) & M32]).unsqueeze(-1)  # [2, B, 1] low, high words

    def _key_words(self, device: torch.device) -> torch.Tensor:
        """[2, B, 1] the keys' low and high 32-bit words on `device` (moved there once)."""
        if self._words.device != device:
            self._words = self._words.to(device)
        return self._words

    @classmethod
    def from_generators(cls, generator, batch: int, device: torch.device | str = "cpu") -> KeyedNoise:
        """One key per row drawn from the user's generator(s): a list (one per row), one generator (the keys in row
        order) or None (torch's global generator)."""
        from mmspec.sampling import generator_list

        gens = generator_list(generator, batch)
        if gens is None:
            where = generator.device if isinstance(generator, torch.Generator) else "cpu"
            keys = torch.randint(0, KEY_RANGE, (batch,), generator=generator, device=where)
        else:
            keys = torch.cat([torch.randint(0, KEY_RANGE, (1,), generator=g, device=g.device).cpu() for g in gens])
        return cls(keys.to(device=device, dtype=torch.int64))

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]


    def select_rows(self, rows: torch.Tensor) -> KeyedNoise:
        """The keys of rows [B'] (the loop drops finished rows), same coupling."""
        return KeyedNoise(self.keys.index_select(0, rows.to(self.keys.device)), self.coupled)

    def repeat(self, times: int) -> KeyedNoise:
        """Each row's key `times` times in a row ([B * times]): a row's images share its key (use an index offset)."""
        return KeyedNoise(self.keys.repeat_interleave(times), self.coupled)

    def _base(self, index: torch.Tensor, purpose: str, sub: torch.Tensor | int) -> torch.Tensor:
        """The 32-bit hash [B, K] of (row key, index [B, K], purpose, sub-key), before its two output streams
        (`mix32(x ^ HIGH)`, `mix32(x ^ LOW)`)."""
        check(purpose in PURPOSES, f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}.")
        lo, hi = self._key_words(index.device)  # [B, 1] each
        x = mix32((index.long() & M32) ^ PURPOSES[purpose])  # [B, K]
        salt = sub.long() * 0x9E3779B1 if isinstance(sub, torch.Tensor) else sub * 0x9E3779B1  # (an int: no tensor)
        x = mix32(x ^ (salt & M32))
        x = mix32(x ^ lo)
        return mix32(x ^ hi)

    def uniforms(self, index: torch.Tensor, purpose: str, sub: torch.Tensor | int = 0) -> torch.Tensor:
        """float64 uniforms in (0, 1) [B, K] at token indices [B, K] (`sub` [B, K] or an int tells apart several
        numbers at one index, e.g. a tree's nodes)."""
        x = self._base(index, purpose, sub)  # [B, K]
        return to_uniform(mix32(x ^ HIGH), mix32(x ^ LOW))

    def exponentials(self, index: torch.Tensor, purpose: str, vocab: int, sub: torch.Tensor | int = 0) -> torch.Tensor:
        """float64 Exp(1) draws [B, K, V] at token indices [B, K]: one per vocabulary entry, for the exponential race
        (a 32-bit uniform each: one hash per entry, half the cost of 53 bits; the race's ties stay ~2^-32)."""
        base = mix32(self._base(index, purpose, sub) ^ HIGH)  # [B, K] (the high stream alone)
        words = mix32(base.unsqueeze(-1) ^ vocabulary_salts(vocab, index.device))  # [B, K, V]
        return -torch.log((words.double() + 0.5) * (2.0 ** -32))

    def draft_exponentials(self, index: torch.Tensor, vocab: int, step: int) -> torch.Tensor:
        """A drafter's Exp(1) draws [B, K, V] for its samples at token indices [B, K] in loop step `step`: under a
        coupled rule the target's own "sample" noise (a draft is then the target's sample wherever their laws agree);
        else "draft" noise, fresh at every step (independent of the rule's numbers and of earlier drafts there, as
        speculative sampling and SJD draw them)."""
        if self.coupled:
            return self.exponentials(index, "sample", vocab)
        return self.exponentials(index, "draft", vocab, sub=step)
