"""The sampler's Gumbel noise is murmur3 of (seed, step, column), bit for bit.

Written against Python's integers (no wrap-around anywhere), so it also checks that the int64
products the tensor code lets wrap keep their low 32 bits, for seeds across the whole int64
range (negative ones included: a request's seed is signed).
"""

from __future__ import annotations

import torch
from relax_hf.sampling import gumbel_noise

M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def _key(k: int) -> int:
    return (_rotl((k * 0xCC9E2D51) & M32, 15) * 0x1B873593) & M32


def _mix(h: int, k: int) -> int:
    return (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _murmur3(seed: int, step: int, column: int) -> int:
    unsigned = seed & (2**64 - 1)
    h = 0
    for part in (unsigned & M32, unsigned >> 32, step & M32, column):
        h = _mix(h, _key(part))
    return _fmix(h ^ 16)


def test_gumbel_noise_is_murmur3_of_seed_step_and_column() -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat(
        (
            torch.randint(-(2**63), 2**63 - 1, (24,), generator=gen, dtype=torch.int64),
            torch.tensor([0, -1, 1, 2**63 - 1, -(2**63), 2**32, 2**32 - 1, 7]),
        )
    )
    steps = torch.randint(0, 2**40, (len(seeds),), generator=gen, dtype=torch.int64)
    vocab = 50021
    noise = gumbel_noise(seeds, steps, vocab)
    assert noise.shape == (len(seeds), vocab) and noise.dtype == torch.float32
    columns = [0, 1, 2, 777, 31999, vocab - 1]
    for row, (seed, step) in enumerate(zip(seeds.tolist(), steps.tolist(), strict=True)):
        hashed = torch.tensor(
            [float(_murmur3(seed, step, c)) for c in columns], dtype=torch.float32
        )
        u = ((hashed + 0.5) * (1.0 / 4294967296.0)).clamp(max=1.0 - 2.0**-24)
        assert torch.equal(noise[row, columns], -torch.log(-torch.log(u))), (seed, step)
    # A pure function: the same rows again give the same noise; another step does not.
    assert torch.equal(gumbel_noise(seeds, steps, vocab), noise)
    assert not torch.equal(gumbel_noise(seeds, steps + 1, vocab), noise)
