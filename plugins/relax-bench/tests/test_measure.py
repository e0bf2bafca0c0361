"""``relax run --measure``'s switch report: each phase switch against the copy of its bytes,
and the run probe ``switching`` that measures them, as the core starts it through
``relax_register_run_probes``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from relax_bench.measure import Switch, SwitchProbe, switch_hops, switch_report
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from relax_core import LifecycleResult, Outcome, PluginManager, ReplicaResult
from relax_core.testing import serve_app


class Engine:
    """One engine head's ``/server_info``: its weights and KV cache resident or not."""

    def __init__(self) -> None:
        self.resident = True

    def app(self) -> Starlette:
        async def info(request: Request) -> JSONResponse:
            weights, kv = (1000, 5000) if self.resident else (0, 0)
            memory = {"param_bytes": 1000, "resident_param_bytes": weights}
            memory["kv_cache"] = {"bytes": kv, "pool_bytes": 5000}
            return JSONResponse({"memory": memory, "generation_tokens_total": 42})

        return Starlette(routes=[Route("/server_info", info)])


def _result(operation: str, manager: float, worker: float) -> LifecycleResult:
    """A manager's result of one switch of one replica, with the hops it reports."""
    replica = ReplicaResult(
        "judge/replica-0", Outcome.DONE, "READY", seconds=worker,
        timings={"engine_calls": worker / 2},
    )  # fmt: skip
    timings = {"publish_begin": 0.001, "heads": worker + 0.001, "publish_wait": 0.0}
    return LifecycleResult(operation, "judge", (replica,), manager, timings | {"publish": 0.002})


@attrs.frozen
class SwitchRecord:
    """What the probe reads of a role's last switch (the lease engine's record)."""

    number: int
    method: str
    seconds: float
    results: tuple[LifecycleResult, ...]


@attrs.frozen
class Status:
    """What the probe reads of the coordinator's ``describe()``."""

    switches: dict[str, SwitchRecord]


class Coordinator:
    """Switches the judge's engine and records each switch as the lease engine does; an
    ``activate`` of an ACTIVE role switches nothing. ``describe`` is not measured."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.switches: dict[str, SwitchRecord] = {}

    def _record(self, role: str, method: str) -> None:
        number = 1 + max((r.number for r in self.switches.values()), default=0)
        result = _result(method, 0.02, 0.01)
        self.switches[role] = SwitchRecord(number, method, 0.03, (result,))

    async def activate(
        self, role: str, operation_id: str, *, batch_id: int, models: Sequence[str] = ()
    ) -> str:
        if not self.engine.resident:
            self.engine.resident = True
            self._record(role, "onload")
        return "ACTIVE"

    async def deactivate(self, role: str, operation_id: str, *, batch_id: int) -> str:
        self.engine.resident = False
        self._record(role, "offload")
        return "IDLE"

    async def describe(self) -> Status:
        return Status(dict(self.switches))


class Handle:
    """The generation model's handle: its own switches."""

    name = "rollout.policy"

    async def onload(self) -> str:
        return "onloaded"

    async def offload(self) -> LifecycleResult:
        return _result("offload", 0.005, 0.004)


class Trainer:
    """Times a copy of each byte count it is asked about (here: says it did)."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    async def measure_copy(self, sizes: Sequence[int]) -> dict[int, dict[str, float]]:
        self.asked.append(list(sizes))
        return {size: {"h2d": 10.0, "d2h": 10.0} for size in sizes}


def test_the_installed_plugin_registers_the_run_probe_of_measure(
    plugin_manager: PluginManager,
) -> None:
    registered = plugin_manager.registered("run_probes")["switching"]
    assert (registered.plugin, registered.distribution) == ("bench", "relax-bench")
    assert registered.record.start is SwitchProbe


def test_the_probe_measures_the_switches_of_what_it_wraps_and_reports_them(
    plugin_manager: PluginManager,
) -> None:
    judge = Engine()

    async def main(url: str) -> tuple[dict[str, Any], Any, Trainer]:
        async def heads(role: str) -> list[str]:
            return [url] if role == "judge" else []

        probe = plugin_manager.run_probe("switching").start(
            heads=heads, generation_role="rollout", step_of={"onload": 3, "offload": 2}.get
        )
        coordinator: Any = probe.coordinator(Coordinator(judge))
        rollout: Any = probe.rollout(Handle())
        assert await coordinator.deactivate("judge", "op", batch_id=1) == "IDLE"
        assert await coordinator.activate("judge", "op", batch_id=2) == "ACTIVE"
        assert await coordinator.activate("judge", "op", batch_id=2) == "ACTIVE"  # no switch
        assert (await rollout.offload()).operation == "offload"
        assert await rollout.onload() == "onloaded"
        trainer = Trainer()
        return await probe.report(trainer, step_seconds=10.0), coordinator, trainer

    with serve_app(judge.app()) as url:
        report, coordinator, trainer = asyncio.run(main(url))
    assert isinstance(asyncio.run(coordinator.describe()), Status)  # forwarded, not measured
    switches = [(s["step"], s["role"], s["direction"]) for s in report["switches"]]
    assert switches == [
        (1, "judge", "offload"), (2, "judge", "onload"), (2, "judge", "onload"),
        (2, "rollout", "offload"), (3, "rollout", "onload"),
    ]  # fmt: skip
    # Each hop the coordinator, the manager and its worker reported, outermost first; an
    # activation that switched nothing and a handle that returned no LifecycleResult have
    # only the switch's own seconds.
    hops = [list(s["hops"]) for s in report["switches"]]
    inside = ["manager", "publish_begin", "heads", "publish_wait", "publish", "worker"]
    assert hops[0] == hops[1] == ["switch", "coordinator", *inside, "engine_calls"]
    assert hops[2] == hops[4] == ["switch"]
    assert hops[3] == ["switch", *inside, "engine_calls"]
    judge = report["switches"][0]
    assert judge["hops"]["coordinator"] == 0.03 and judge["manager_seconds"] == 0.02
    assert judge["worker_seconds"] == judge["hops"]["worker"] == 0.01
    offload, onload = report["switches"][:2]
    assert (offload["held_before"], offload["held_after"]) == (6000, 0)
    assert offload["freed_fraction"] == 1.0 and onload["held_after"] == 6000
    assert offload["weight_bytes"] == 1000 and offload["kv_cache_bytes"] == 5000
    assert offload["counters_before"] == {"generation_tokens_total": 42}
    # The trainer timed one copy of each weight size the switches moved (none for rollout's).
    assert trainer.asked == [[0, 1000]] and offload["copy_seconds"] == 10.0
    assert report["all_within_limit"] is True and report["step_seconds"] == 10.0


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
    from relax_bench.measure import _counters

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


def test_the_hops_of_a_switch_are_the_slowest_of_each_and_the_engines_own_from_their_logs() -> None:
    slow, fast = _result("onload", 0.02, 0.015), _result("onload", 0.01, 0.005)
    resume = {"weights": {"seconds": 0.004}, "kv_cache": {"seconds": 0.001}}
    ops = [
        [
            {
                "op": "resume",
                "detail": resume
                | {"generation_check_seconds": 0.003, "generation_check_step_seconds": 0.001},
                "seconds": 0.006,
            }
        ],
        [{"op": "resume", "detail": {"weights": {"seconds": 0.002}}, "seconds": 0.007}],
    ]
    hops = switch_hops(0.05, 0.04, [slow, fast], ops)
    assert hops == {
        "switch": 0.05, "coordinator": 0.04, "manager": 0.02, "publish_begin": 0.001,
        "heads": 0.016, "publish_wait": 0.0, "publish": 0.002, "worker": 0.015,
        "engine_calls": 0.0075, "engine_op": 0.007, "engine": 0.005, "generation_check": 0.003,
        "generation_check_step": 0.001,
    }  # fmt: skip
    # Rollout's own switch (no coordinator), with an engine that keeps no memory log.
    assert switch_hops(0.01, None, [], [None]) == {"switch": 0.01}
