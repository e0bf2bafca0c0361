"""A ``/generate`` answer's weight version spans (SGLang's ``meta_info.weight_versions``, which
the hf engine answers: plugins/relax-hf/tests/test_weights.py) become the sample's version
boundaries; one span, or none, leaves them empty."""

from __future__ import annotations

from typing import Any

import pytest

from relax_core.errors import UpstreamError
from relax_core.run.data import Prompt
from relax_core.run.generate import _sample
from relax_core.run.rollout import parse_answer


def _answer(spans: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "output_token_logprobs": [[-0.1, t, None] for t in range(4)],
        "weight_version": "st-1",
    }
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "abcd", "output_ids": [1, 2, 3, 4], "meta_info": meta}


def test_a_response_spanning_a_push_carries_both_versions() -> None:
    spans = [
        {"version": "ckpt", "start": 0, "end": 3},
        {"version": "st-1", "start": 3, "end": 4},
    ]
    s = _sample("s", "g", [9], Prompt("p"), parse_answer("s", _answer(spans)))
    assert s.weight_versions == ((0, "ckpt"), (3, "st-1")) and s.weight_version == "st-1"
    assert s.versions == ((0, "ckpt"), (3, "st-1"))
    assert s.staged_copy().weight_versions == s.weight_versions


@pytest.mark.parametrize("spans", [None, [{"version": "st-1", "start": 0, "end": 4}]])
def test_one_version_leaves_noboundaries(spans: Any) -> None:
    s = _sample("s", "g", [9], Prompt("p"), parse_answer("s", _answer(spans)))
    assert s.weight_versions == () and s.versions == ((0, "st-1"),)


def test_spans_that_are_not_spans_are_an_upstream_error() -> None:
    with pytest.raises(UpstreamError, match="weight_versions"):
        _sample("s", "g", [9], Prompt("p"), parse_answer("s", _answer([{"start": "x"}])))


def test_a_trajectory_spanning_a_push_carries_each_turns_version() -> None:
    from relax_core.run.rollout import add_segments, boundaries

    segments: list[tuple[int, str | None]] = []
    # Turn 0 (tokens 0-3) under ckpt; environment tokens 4-6; turn 1 (7-10) began under
    # ckpt and met a push after two tokens.
    add_segments(segments, 0, parse_answer("t0", _answer(None) | {"meta_info": _meta("ckpt")}))
    spans = [{"version": "ckpt", "start": 0, "end": 2}, {"version": "st-1", "start": 2, "end": 4}]
    add_segments(segments, 7, parse_answer("t1", _answer(spans)))
    assert boundaries(segments) == ((0, "ckpt"), (9, "st-1"))
    one: list[tuple[int, str | None]] = []
    add_segments(one, 0, parse_answer("t0", _answer(None)))
    add_segments(one, 7, parse_answer("t1", _answer(None)))
    assert boundaries(one) == ()  # one version made every turn


def _meta(version: str) -> dict[str, Any]:
    return {"output_token_logprobs": [[-0.1, t, None] for t in range(4)], "weight_version": version}
