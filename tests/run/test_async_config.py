"""``[run] mode = "async"``: its keys, and what a layout whose generation role takes turns
overlaps (every layout runs async steps)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from relax_core.config import JobConfig, parse_config
from relax_core.coordination.residency import ResidencyPlan
from relax_core.errors import ConfigValidationError
from relax_core.run.config import parse_run_config
from relax_core.run.loop import async_overlap_note

HF = {"backend": "hf", "model_path": "/m"}


def _job(run: dict[str, object], **placement: object) -> JobConfig:
    return parse_config(
        {
            "placement": placement,
            "roles": {
                "rollout": {
                    "models": {
                        "policy": {"backend": "hf", "model_path": "/m", "weight_source": "ACTOR"}
                    }
                }
            },
            "run": {"rewards": [{"adapter": "exact-match"}], **run},
        }
    )


def test_async_keys_parse_with_their_defaults() -> None:
    run = parse_run_config(_job({"mode": "async"}))
    assert (run.mode, run.max_staleness, run.stale_action, run.stream_scoring) == (
        "async", 1, "regenerate", True,
    )  # fmt: skip
    assert parse_run_config(_job({})).mode == "sync"


@pytest.mark.parametrize(
    ("run", "where", "says"),
    [
        ({"mode": "later"}, "run.mode", "one of"),
        ({"mode": "async", "max_staleness": -1}, "run.max_staleness", ">= 0"),
        ({"mode": "async", "stale_action": "keep"}, "run.stale_action", "one of"),
        ({"max_staleness": 2}, "run.max_staleness", "mode = 'async' only"),
        ({"mode": "async", "importance_cap": 0.5}, "run.importance_cap", "cap >= 1"),
    ],
)
def test_bad_async_keys_are_refused_at_their_key_path(
    run: dict[str, object], where: str, says: str
) -> None:
    with pytest.raises(ConfigValidationError) as info:
        parse_run_config(_job(run))
    problems = [p for p in info.value.problems if p.path == where]
    assert problems and says in problems[0].message, info.value.problems


def _started(free: set[str], slices: dict[str, str]) -> Any:
    # the three attributes of a started RunJob the note reads (a started job needs Ray)
    plan = ResidencyPlan(free=frozenset(free), mode="planned" if free else "exclusive")
    return SimpleNamespace(generation_role="rollout", residency=plan, slices=slices)


def test_a_layout_whose_generation_role_takes_turns_overlaps_only_training() -> None:
    split = _started({"rollout", "genrm"}, {"rollout": "actor:0-3", "genrm": "actor:4-5"})
    assert async_overlap_note(split) is None
    defer = _started(set(), {"rollout": "actor:0-7", "genrm": "actor:0-7", "teacher": "actor:0-7"})
    note = async_overlap_note(defer)
    assert note is not None
    assert "rollout takes turns with genrm, teacher" in note
    assert "training overlaps generation but scoring does not" in note and "'split'" in note
