"""``relax run --measure``'s switch report: each phase switch against the copy of its bytes."""

from __future__ import annotations

import math

import attrs
import pytest

from relax_core.run.measure import Switch, switch_report


def test_the_switch_report_sets_each_switch_against_the_copy_of_its_bytes() -> None:
    def switch(direction: str, seconds: float, free_before: int, free_after: int) -> Switch:
        return Switch(
            step=0, role="genrm", direction=direction, seconds=seconds, weight_bytes=1000,
            kv_cache_bytes=5000, held_before=6000 if direction == "offload" else 0,
            held_after=0 if direction == "offload" else 6000, device_free_before=free_before,
            device_free_after=free_after, device_total=10_000,
        )  # fmt: skip

    report = switch_report(
        [switch("onload", 0.06, 9000, 3000), switch("offload", 0.2, 3000, 8700)],
        {1000: {"h2d": 0.01, "d2h": 0.02}},
        step_seconds=2.6,
    )
    onload, offload = report["switches"]
    assert onload["copy_seconds"] == 0.01 and onload["limit_seconds"] == pytest.approx(0.0625)
    assert onload["within_limit"] is True and "freed_fraction" not in onload
    assert offload["copy_seconds"] == 0.02 and offload["within_limit"] is False
    assert offload["freed_fraction"] == pytest.approx(5700 / 6000)
    assert report["switch_seconds"] == pytest.approx(0.26)
    assert report["share_of_step"] == pytest.approx(0.1)
    assert report["all_within_limit"] is False and report["min_freed_fraction"] == 0.95
    assert math.isclose(onload["copy_gb_per_s"], 1000 / 0.01 / 1e9)


def test_memory_an_offload_hands_over_counts_as_freed_and_is_reported_apart() -> None:
    # An engine with --memory-handoff parks most of what it held for the next role: the
    # device's free memory moves only by the rest (its torch cache), yet the role holds nothing.
    handed = Switch(
        step=0, role="rollout", direction="offload", seconds=0.04, weight_bytes=1000,
        kv_cache_bytes=9000, held_before=10_000, held_after=0, device_free_before=4000,
        device_free_after=4800, device_total=20_000, parked_before=0, parked_after=9200,
    )  # fmt: skip
    taken = attrs.evolve(
        handed, direction="onload", held_before=0, held_after=10_000, device_free_before=4800,
        device_free_after=4800, parked_before=0, parked_after=0,
    )  # fmt: skip
    report = switch_report([handed, taken], {1000: {"h2d": 0.01, "d2h": 0.01}}, step_seconds=1.0)
    offload, onload = report["switches"]
    assert offload["handed_over_bytes"] == 9200 and offload["freed_bytes"] == 800 + 9200
    assert offload["freed_fraction"] == pytest.approx(1.0)
    assert onload["handed_over_bytes"] == 0 and onload["freed_bytes"] == 0
    # Without the hand-over the same device numbers would have freed only 8%.
    plain = attrs.evolve(handed, parked_after=0)
    assert switch_report([plain], {}, step_seconds=1.0)["min_freed_fraction"] == pytest.approx(0.08)


def test_a_switch_records_the_engines_counters_summed_over_its_heads() -> None:
    from relax_core.run.measure import _counters

    def info(tokens: int, captures: int | None) -> dict[str, object]:
        graphs = {} if captures is None else {"captures": captures, "replays": 2 * captures}
        return {
            "generation_tokens_total": tokens,
            "prefill_tokens_total": 3 * tokens,
            "decode_steps_total": tokens // 2,
            "memory": {"cuda_graphs": graphs},
        }

    counters = _counters([info(100, 4), info(10, None)])
    assert counters == {
        "generation_tokens_total": 110,
        "prefill_tokens_total": 330,
        "decode_steps_total": 55,
        "cuda_graph_captures": 4,
        "cuda_graph_replays": 8,
    }
    s = Switch(
        step=1, role="genrm", direction="offload", seconds=0.1, weight_bytes=1, kv_cache_bytes=1,
        held_before=1, held_after=0, device_free_before=None, device_free_after=None,
        device_total=None, counters_before=counters, counters_after={"cuda_graph_captures": 4},
    )  # fmt: skip
    (row,) = switch_report([s], {}, step_seconds=1.0)["switches"]
    assert row["counters_before"]["generation_tokens_total"] == 110
    assert row["counters_after"] == {"cuda_graph_captures": 4}
