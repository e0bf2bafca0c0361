"""Batched sampling: logit processors (SGLang's order and meaning), then one draw per row.

:func:`process_logits` applies, row by row but in batched tensor ops, what a request's
sampling parameters ask for: ``logit_bias`` (added), the penalties on the tokens generated so
far (``frequency_penalty`` x count and ``presence_penalty`` subtracted, ``repetition_penalty``
dividing positive and multiplying negative logits, as SGLang's penalizers do; prompt tokens are
not counted, as in SGLang), ``min_new_tokens`` (stop tokens banned until then) and the grammar
mask. :func:`draw` then picks one token per row: argmax for greedy rows; otherwise temperature,
top-k, top-p and min-p, and the Gumbel-max trick with noise from a counter-based hash
(murmur3 of the row's seed, the index of the token being sampled and the vocabulary id, the
construction SGLang uses for ``sampling_seed``). The noise of a row depends on nothing but that
row, so a seeded request's tokens do not depend on the rest of the batch, on the device kind or
on a retraction; there is no generator state to carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from relax_hf.protocol import SamplingParams

__all__ = [
    "SampleRow",
    "column_keys",
    "derive_seed",
    "draw",
    "gumbel_from",
    "gumbel_from_keys",
    "gumbel_noise",
    "process_logits",
    "row_keys",
    "sampling_support",
    "scaled_logprobs",
]

_M32 = 0xFFFFFFFF


class SampleRow(Protocol):
    """What the sampler reads from a sequence (see :class:`relax_hf.batch.Sequence`)."""

    sampling: SamplingParams
    seed: int
    output_ids: list[int]
    counts: torch.Tensor | None
    bias: torch.Tensor | None
    grammar: Any


#: Integer arrays the hash's row part runs on alike: tensors, or numpy int64 arrays on the host.
_Ints = TypeVar("_Ints", torch.Tensor, "np.ndarray[Any, np.dtype[np.int64]]")


def _mul32(a: _Ints, c: int) -> _Ints:
    """``a * c mod 2**32`` for ``a`` and ``c`` in [0, 2**32): the low bits of the int64
    product, which keeps them when it wraps (two's complement, on every device)."""
    return (a * c) & _M32


def _rotl32(x: _Ints, r: int) -> _Ints:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix_key(k: _Ints) -> _Ints:
    return _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)


def _mix(h: _Ints, k_mixed: _Ints) -> _Ints:
    return (_rotl32(h ^ k_mixed, 13) * 5 + 0xE6546B64) & _M32


_COL_KEYS: dict[tuple[str, int], torch.Tensor] = {}


def column_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """Each column's mixed key, rotated as :func:`_mix` rotates it (``[1, vocab]``; cached per
    device and vocabulary)."""
    key = (str(device), vocab)
    cached = _COL_KEYS.get(key)
    if cached is None:
        keys = _mix_key(torch.arange(vocab, dtype=torch.int64, device=device))
        cached = _rotl32(keys, 13)[None, :]
        _COL_KEYS[key] = cached
    return cached


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[rows, vocab]`` (float32), a pure function of (seed, step, column).

    ``seeds`` and ``steps`` are int64 ``[rows]`` on the target device; the hash is murmur3 over
    the seed's two 32-bit halves, the step and the column, exact in integer arithmetic on any
    device. Over ``[rows, vocab]`` it takes 21 element-wise passes, in place where it can (a
    decode step's sampler is mostly these): the rows' part of the hash is mixed per row
    (:func:`row_keys`), and a rotation of ``row ^ column`` is that of the row's xor the
    column's (cached).
    """
    return gumbel_from(seeds, steps, column_keys(vocab, seeds.device))


def row_keys(seeds: _Ints, steps: _Ints) -> _Ints:
    """The rows' part of the noise's hash (int64 ``[rows]``): murmur3 over the seed's two
    32-bit halves and the step, rotated as the column's part is (:func:`gumbel_from_keys`).
    Plain integer operators only, so numpy int64 arrays give the same keys as tensors: the
    decode step's are computed on the host with its other inputs, ~57 kernels of a few
    elements each that the device no longer runs every step."""
    h = _mix(seeds * 0, _mix_key(seeds & _M32))
    h = _mix(h, _mix_key((seeds >> 32) & _M32))
    h = _mix(h, _mix_key(steps & _M32))
    return _rotl32(h, 13)


def gumbel_from(seeds: torch.Tensor, steps: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """:func:`gumbel_noise` with the columns' keys given (:func:`column_keys`): tensor
    operations only, so ``torch.compile`` fuses it whole."""
    return gumbel_from_keys(row_keys(seeds, steps), columns)


def gumbel_from_keys(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """:func:`gumbel_noise` of the rows' :func:`row_keys` and the columns' keys."""
    x = keys[:, None] ^ columns
    # The column's _mix, then murmur3's length (16 bytes) and its finaliser.
    x.mul_(5).add_(0xE6546B64).bitwise_and_(_M32).bitwise_xor_(16)
    x.bitwise_xor_(x >> 16).mul_(0x85EBCA6B).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 13).mul_(0xC2B2AE35).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    u = x.to(torch.float32).add_(0.5).mul_(1.0 / 4294967296.0).clamp_(max=1.0 - 2.0**-24)
    return u.log_().neg_().log_().neg_()


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (``n`` > 1).

    Sample 0 keeps the request's seed; the others get a splitmix64 mix of (seed, index), so the
    samples differ from each other and from requests seeded with ``seed + 1``.
    """
    if index == 0:
        return seed
    mask = (1 << 64) - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


def process_logits(
    logits: torch.Tensor, rows: Sequence[SampleRow], eos_ids: frozenset[int]
) -> torch.Tensor:
    """Apply logit bias, penalties, ``min_new_tokens`` and grammar masks (float32, new tensor)."""
    z = logits.float()
    device = z.device
    biased = [i for i, r in enumerate(rows) if r.bias is not None]
    if biased:
        z = z.clone() if z is logits else z
        idx = torch.tensor(biased, device=device)
        z.index_add_(0, idx, torch.stack([rows[i].bias for i in biased]))  # type: ignore[misc]
    penal = [i for i, r in enumerate(rows) if r.counts is not None and r.sampling.penalized]
    if penal:
        z = z.clone() if z is logits else z
        idx = torch.tensor(penal, device=device)
        counts = torch.stack([rows[i].counts for i in penal])  # type: ignore[misc]
        sub = z.index_select(0, idx)
        rep = torch.tensor([rows[i].sampling.repetition_penalty for i in penal], device=device)
        seen = counts > 0
        scaled = torch.where(sub < 0, sub * rep[:, None], sub / rep[:, None])
        sub = torch.where(seen, scaled, sub)
        freq = torch.tensor([rows[i].sampling.frequency_penalty for i in penal], device=device)
        pres = torch.tensor([rows[i].sampling.presence_penalty for i in penal], device=device)
        sub = sub - freq[:, None] * counts - pres[:, None] * seen.float()
        z.index_copy_(0, idx, sub)
    banned: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        sp = r.sampling
        if sp.min_new_tokens and len(r.output_ids) < sp.min_new_tokens:
            ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
            banned += [(i, t) for t in ids if t < z.shape[-1]]
    if banned:
        z = z.clone() if z is logits else z
        bi = torch.tensor(banned, device=device)
        z[bi[:, 0], bi[:, 1]] = float("-inf")
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:
        z = z.clone() if z is logits else z
        allowed = torch.stack([rows[i].grammar.allowed() for i in constrained]).to(device)
        idx = torch.tensor(constrained, device=device)
        z.index_copy_(0, idx, z.index_select(0, idx).masked_fill(~allowed, float("-inf")))
    return z


def _temperatures(rows: Sequence[SampleRow], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [1.0 if r.sampling.greedy else r.sampling.temperature for r in rows], device=device
    )


def scaled_logprobs(z: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """``log_softmax(z / temperature)`` per row (raw logits for greedy rows), as SGLang returns."""
    return torch.log_softmax(z / _temperatures(rows, z.device)[:, None], dim=-1)


def _filtered(z: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """``z / temperature`` of each (sampled, not greedy) row with top-k, top-p and min-p
    applied: the log-weights of the distribution a draw samples (``-inf`` outside it)."""
    device = z.device
    filt = z / torch.tensor([r.sampling.temperature for r in rows], device=device)[:, None]
    vocab = filt.shape[-1]
    ks = [r.sampling.top_k if 0 < r.sampling.top_k < vocab else 0 for r in rows]
    if any(ks):
        top = torch.topk(filt, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None])
        kth = torch.where(
            torch.tensor(ks, device=device)[:, None] > 0, kth, torch.full_like(kth, -torch.inf)
        )
        filt = filt.masked_fill(filt < kth, -torch.inf)
    top_ps = [r.sampling.top_p for r in rows]
    min_ps = [r.sampling.min_p for r in rows]
    if any(p < 1.0 for p in top_ps) or any(min_ps):
        probs = torch.softmax(filt, dim=-1)
        if any(p < 1.0 for p in top_ps):
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) > torch.tensor(top_ps, device=device)[:, None]
            probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
        if any(min_ps):
            floor = torch.tensor(min_ps, device=device)[:, None] * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        filt = torch.log(probs)
    return filt


def draw(z: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """One token id per row (int64 tensor on ``z``'s device) from processed logits ``z``."""
    device = z.device
    tokens = torch.argmax(z, dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
    if not sampled:
        return tokens
    sub_rows = [rows[i] for i in sampled]
    idx = torch.tensor(sampled, device=device)
    filt = _filtered(z.index_select(0, idx), sub_rows)
    keys = row_keys(
        np.array([r.seed for r in sub_rows], dtype=np.int64),
        np.array([len(r.output_ids) for r in sub_rows], dtype=np.int64),
    )
    noise = gumbel_from_keys(torch.from_numpy(keys).to(device), column_keys(filt.shape[-1], device))
    picked = torch.argmax(filt + noise, dim=-1)
    tokens[idx] = picked
    return tokens


def sampling_support(
    z: torch.Tensor, rows: Sequence[SampleRow], tokens: Sequence[int]
) -> list[tuple[list[int], list[float]]]:
    """SGLang's sampling mask of each row: the token ids with a positive probability in the
    distribution its token was drawn from (most likely first) and their log-probabilities
    (renormalised over that support). A greedy row's support is its token, log-prob 0."""
    out: list[tuple[list[int], list[float]]] = [([t], [0.0]) for t in tokens]
    sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
    if not sampled:
        return out
    idx = torch.tensor(sampled, device=z.device)
    lp = torch.log_softmax(_filtered(z.index_select(0, idx), [rows[i] for i in sampled]), -1)
    for j, i in enumerate(sampled):
        row = lp[j]
        ids = torch.nonzero(torch.isfinite(row)).squeeze(1)
        values, order = torch.sort(row.index_select(0, ids), descending=True)
        out[i] = (ids.index_select(0, order).tolist(), values.tolist())
    return out
