"""Validation of a staged batch's scored fields, before anything is written back.

The checks follow what each stage says it wrote:

- ``reward`` / ``rewards``: every sample has a finite reward (a reward adapter matched it), and
  every per-adapter value is finite;
- ``teacher_logprobs`` / ``student_logprobs``: exactly one finite log-prob <= 0 per response
  token;
- ``teacher_topk_ids`` / ``teacher_topk_logprobs`` with top-k width ``k``: shaped
  ``[response tokens][k]``, ids non-negative ints, log-probs finite, <= 0 and sorted
  descending along each row.

:func:`validate_samples` returns every problem (sample id, group, field, what is wrong);
:func:`check_samples` raises :class:`~relax_core.errors.ScoringError` naming the first few.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from relax_core.coordination.sample import Sample
from relax_core.errors import ScoringError

__all__ = ["check_samples", "validate_samples"]

_SHOWN = 5


def _fine(values: Any) -> bool:
    """Fast path (C loops): every value a finite number <= 0. False means "look closer"."""
    if not values:
        return True
    try:
        return bool(max(values) <= 0 and math.isfinite(math.fsum(values)))
    except (TypeError, ValueError, OverflowError):
        return False


def _logprob_problem(values: object, tokens: int, field: str) -> str | None:
    if not isinstance(values, tuple | list):
        return f"{field} is missing ({type(values).__name__})"
    if len(values) != tokens:
        return f"{field} has {len(values)} entries for {tokens} response tokens (one per token)"
    if _fine(values):
        return None
    for i, v in enumerate(values):
        if not isinstance(v, float | int) or not math.isfinite(v) or v > 0:
            return f"{field}[{i}] = {v!r} is not a finite log-prob <= 0"
    return None


def _topk_problem(ids: object, lps: object, tokens: int, k: int) -> str | None:
    for name, rows in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", lps)):
        if not isinstance(rows, tuple | list):
            return f"{name} is missing ({type(rows).__name__})"
        if len(rows) != tokens:
            return f"{name} has {len(rows)} rows for {tokens} response tokens"
    assert isinstance(ids, tuple | list) and isinstance(lps, tuple | list)
    for t, (id_row, lp_row) in enumerate(zip(ids, lps, strict=True)):
        if not isinstance(id_row, tuple | list) or len(id_row) != k:
            return f"teacher_topk_ids[{t}] is not {k} ids (shape [tokens, {k}])"
        if not isinstance(lp_row, tuple | list) or len(lp_row) != k:
            return f"teacher_topk_logprobs[{t}] is not {k} log-probs (shape [tokens, {k}])"
        for j, i in enumerate(id_row):
            if type(i) is not int or i < 0:
                return f"teacher_topk_ids[{t}][{j}] = {i!r} is not a token id"
        if _fine(lp_row) and list(lp_row) == sorted(lp_row, reverse=True):
            continue
        prev = math.inf
        for j, v in enumerate(lp_row):
            if not isinstance(v, float | int) or not math.isfinite(v) or v > 0:
                return f"teacher_topk_logprobs[{t}][{j}] = {v!r} is not a finite log-prob <= 0"
            if v > prev:
                return f"teacher_topk_logprobs[{t}] is not sorted descending (at {j})"
            prev = v
    return None


def _reward_problem(sample: Sample) -> str | None:
    # Each adapter's value first: a non-finite sum names the adapter that made it so.
    for name, value in sample.rewards.items():
        if not isinstance(value, float | int) or not math.isfinite(value):
            return f"rewards[{name!r}] = {value!r} is not a finite number (adapter {name!r})"
    reward = sample.reward
    if reward is None:
        return "reward is missing (no reward adapter matched its label)"
    if not isinstance(reward, float | int) or not math.isfinite(reward):
        return f"reward = {reward!r} is not a finite number"
    return None


def validate_samples(samples: Iterable[Sample], writes: Iterable[str], top_k: int) -> list[str]:
    """Every problem of the fields named in ``writes`` over ``samples``, as
    ``sample <id> (group <g>): <problem>``; empty when all are valid."""
    fields = frozenset(writes)
    problems = []
    for s in samples:
        tokens = len(s.response_ids)
        found: list[str | None] = []
        if "reward" in fields or "rewards" in fields:
            found.append(_reward_problem(s))
        if "teacher_logprobs" in fields:
            found.append(_logprob_problem(s.teacher_logprobs, tokens, "teacher_logprobs"))
        if top_k > 0 and ("teacher_topk_ids" in fields or "teacher_topk_logprobs" in fields):
            found.append(_topk_problem(s.teacher_topk_ids, s.teacher_topk_logprobs, tokens, top_k))
        if "student_logprobs" in fields:
            found.append(_logprob_problem(s.student_logprobs, tokens, "student_logprobs"))
        problems += [f"sample {s.id} (group {s.group_id}): {p}" for p in found if p]
    return problems


def check_samples(samples: Sequence[Sample], writes: Iterable[str], top_k: int) -> None:
    """Raise :class:`~relax_core.errors.ScoringError` (stage ``validation``) listing the first
    problems and their count; return when every field is valid."""
    problems = validate_samples(samples, writes, top_k)
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ScoringError(
            "validation",
            f"{len(problems)} problem(s) in {len(samples)} staged samples; nothing was written "
            f"back: " + "; ".join(problems[:_SHOWN]) + more,
        )
