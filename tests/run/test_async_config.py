"""``[run] mode = "async"``: its keys, and the layouts the preflight refuses before anything
starts."""

from __future__ import annotations

import pytest

from relax_core.config import JobConfig, parse_config
from relax_core.errors import ConfigValidationError
from relax_core.run.config import parse_run_config
from relax_core.run.job import _mode_problems

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
    assert run.importance_cap == 2.0
    sync = parse_run_config(_job({}))
    assert (sync.mode, sync.importance_cap) == ("sync", 0.0)


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


def test_the_preflight_refuses_layouts_that_cannot_overlap() -> None:
    # the defer roles are what the job's placement names (run_problems passes them)
    defer = _job({"mode": "async"})
    run = parse_run_config(defer)
    [problem] = _mode_problems(defer, run, ("genrm",))
    assert problem.path == "run.mode" and "split" in problem.message
    exclusive = _job({"mode": "async"}, residency="exclusive")
    [problem] = _mode_problems(exclusive, parse_run_config(exclusive), ())
    assert problem.path == "placement.residency"
    plain = _job({"mode": "async"})
    assert _mode_problems(plain, parse_run_config(plain), ()) == []
    assert _mode_problems(defer, parse_run_config(_job({})), ("genrm",)) == []
