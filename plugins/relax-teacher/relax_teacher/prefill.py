"""The on-policy-distillation prefill request and the check of its answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from relax_core import UpstreamError

__all__ = ["PrefillResult", "parse_prefill", "prefill_payload"]


def prefill_payload(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    *,
    top_k: int = 0,
    token_ids_logprob: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The teacher ``/generate`` body scoring ``response_ids`` after ``prompt_ids``.

    No token is generated (``max_new_tokens`` 0); log-probs start at the last prompt position so
    every response token gets one.
    """
    if not prompt_ids or not response_ids:
        raise ValueError("prefill_payload: prompt_ids and response_ids must both be non-empty")
    body: dict[str, Any] = {
        "input_ids": [int(i) for i in (*prompt_ids, *response_ids)],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": max(len(prompt_ids) - 1, 0),
    }
    if top_k:
        body["top_logprobs_num"] = int(top_k)
    if token_ids_logprob is not None:
        body["token_ids_logprob"] = [int(i) for i in token_ids_logprob]
    return body


@attrs.frozen
class PrefillResult:
    """Teacher log-probs of each response token, and the top-k (token id, log-prob) per position."""

    logprobs: tuple[float, ...]
    top_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]


def parse_prefill(answer: Any, response_len: int) -> PrefillResult:
    """Check and unpack a prefill answer for a response of ``response_len`` tokens.

    The engine returns one input log-prob per position from ``logprob_start_len``: response
    length + 1 (the first is the last prompt position's own, with no log-prob).

    :raises UpstreamError: (502) the answer does not have that shape.
    """
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    lps = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(lps, list) or len(lps) != response_len + 1:
        got = len(lps) if isinstance(lps, list) else None
        raise UpstreamError(
            502,
            f"teacher prefill answer has {got} input log-probs, expected response length + 1 = "
            f"{response_len + 1}; check logprob_start_len = prompt_len - 1",
        )
    logprobs = tuple(float(entry[0]) for entry in lps[1:])
    tops = meta.get("input_top_logprobs") or []
    tops = tops[1:] if len(tops) == response_len + 1 else []
    top_ids = tuple(tuple(int(e[1]) for e in pos or ()) for pos in tops)
    top_lps = tuple(tuple(float(e[0]) for e in pos or ()) for pos in tops)
    return PrefillResult(logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps)
