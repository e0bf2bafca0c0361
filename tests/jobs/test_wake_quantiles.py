"""The wake controller's summary of how long requests waited for a wake (nearest rank)."""

from __future__ import annotations

from relax_core.jobs.wake import _quantiles


def test_the_controllers_wake_waits_are_nearest_rank_quantiles() -> None:
    assert _quantiles([0.3, 0.1, 0.2]) == {"count": 3, "p50_s": 0.2, "p99_s": 0.3, "max_s": 0.3}
    assert _quantiles([]) == {"count": 0}
