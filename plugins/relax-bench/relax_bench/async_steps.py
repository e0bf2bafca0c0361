"""``relax bench async``: synchronous vs asynchronous steps of one job, in one run.

The job: ``steps`` steps of a split layout (the policy, a judge and the trainer each on GPUs of
their own) on simulated engines of fixed per-phase times (:mod:`relax_bench._steps_sim`):
generating a batch takes ``generate_s``, scoring it ``score_s``, training on it ``train_s``
(equal by default), a push ``push_s``. Everything between them is the real machinery: the
coordinator's commit gate, the deferred batch (staging, validation, write-back, the sink put,
the commit), the trainer waiting on the gate.

Both modes are ``relax run``'s one :class:`~relax_core.StepDriver`:

- **sync** (``relax run``'s default): ``max_staleness = 0``, nothing streamed — begin the batch,
  push the last weights, generate, score, commit, train, the phases one after the other (≈ 3
  units a step).
- **async**: ``max_staleness = 1`` and streaming scoring: the judge scores each group as it
  completes, and step ``N+1`` is generated and scored while step ``N`` trains (≈ 1 unit a
  step once the pipeline is full: ideal 3x).

``async_vs_sync`` is the ratio of steps per second (the target is >= 1.8), and
``max_staleness_seen`` the largest staleness of any sample trained on (must be <= 1).

``defer``: the same two modes in a defer layout (the judge takes turns with the policy on one
GPU, so nothing streams): async overlaps only training with the next step's generation (the
driver's ``switching`` mode); its ideal ratio is ``(generate + score + train) / (generate +
score)`` (1.5 with equal phases). Reported, not judged against the target.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from relax_bench._steps_sim import SimJudge, SimRollout, SimTrainer, Times, coordinator, handle
from relax_core import (
    DriverSettings,
    MemoryBatchSink,
    RoleClients,
    StepDriver,
    StepOutcome,
    Timeline,
)

TARGET = 1.8
MAX_STALENESS = 1


def _registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


async def _steps(times: Times, steps: int, *, sync: bool, defer: bool = False) -> dict[str, Any]:
    """``steps`` steps through the driver: sync (``max_staleness = 0``, nothing streamed) or
    async (:data:`MAX_STALENESS`, streaming scoring), in a split or a defer layout."""
    coord = coordinator(deferred=("judge",) if defer else ())
    sink = MemoryBatchSink()
    rollout = SimRollout(times)
    trainer = SimTrainer(times, coord, sink, rollout)
    outcomes: list[StepOutcome] = []
    settings = DriverSettings(
        steps=steps,
        prompts_per_step=times.groups,
        max_staleness=0 if sync else MAX_STALENESS,
        stream_scoring=not sync,
    )
    driver = StepDriver(
        settings,
        coordinator=coord,
        rollout=handle(),
        stages=[SimJudge(times)],
        sink=sink,
        clients=RoleClients({}),
        producer=rollout.producer,
        trainer=trainer,
        generation_role="policy",
        deferred_roles=("judge",) if defer else (),
        initial_version="0",
        switching=defer,
        timeline=Timeline(registry=_registry()),
        on_step=outcomes.append,
    )
    began = time.perf_counter()
    await driver.run()
    seconds = time.perf_counter() - began
    out: dict[str, Any] = {
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "trained": len(trainer.trained),
    }
    if sync:
        return out
    histogram: dict[str, int] = {}
    idle: dict[str, list[float]] = {}
    for o in outcomes:
        for k, v in o.metrics["staleness"].items():
            histogram[k] = histogram.get(k, 0) + v
        for role, ratio in o.metrics["idle"].items():
            idle.setdefault(role, []).append(ratio)
    steady = outcomes[2:] or outcomes  # the pipeline's fill is in the first steps
    return {
        **out,
        "staleness": dict(sorted(histogram.items())),
        "max_staleness_seen": max((o.metrics["max_staleness_seen"] for o in outcomes), default=0),
        "partial_samples": sum(o.metrics["partial_samples"] for o in outcomes),
        "stale_dropped_groups": sum(o.metrics["stale"]["dropped_groups"] for o in outcomes),
        "idle_ratio_steady": {
            role: round(sum(o.metrics["idle"][role] for o in steady) / len(steady), 3)
            for role in idle
        },
    }


def rounded(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its floats to four places."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def run(*, quick: bool = False) -> dict[str, Any]:
    """Both modes on the same job; the ratio and the verdict."""
    times = Times(generate_s=0.1, score_s=0.1, train_s=0.1) if quick else Times()
    steps = 8 if quick else 16
    sync = asyncio.run(_steps(times, steps, sync=True))
    pipelined = asyncio.run(_steps(times, steps, sync=False))
    ratio = pipelined["steps_per_s"] / sync["steps_per_s"]
    defer_sync = asyncio.run(_steps(times, steps, sync=True, defer=True))
    defer_async = asyncio.run(_steps(times, steps, sync=False, defer=True))
    return {
        "steps": steps,
        "phase_seconds": {
            "generate": times.generate_s,
            "score": times.score_s,
            "train": times.train_s,
            "push": times.push_s,
        },
        "groups": times.groups,
        "max_staleness": MAX_STALENESS,
        "sync": rounded(sync),
        "async": rounded(pipelined),
        "async_vs_sync": round(ratio, 3),
        "defer": {
            "sync": rounded(defer_sync),
            "async": rounded(defer_async),
            "async_vs_sync": round(defer_async["steps_per_s"] / defer_sync["steps_per_s"], 3),
            "ideal": round(
                (times.generate_s + times.score_s + times.train_s)
                / (times.generate_s + times.score_s),
                3,
            ),
            "max_staleness_seen": defer_async["max_staleness_seen"],
        },
        "max_staleness_seen": pipelined["max_staleness_seen"],
        "target": TARGET,
        "within_target": ratio >= TARGET and pipelined["max_staleness_seen"] <= MAX_STALENESS,
    }


def format_result(result: dict[str, Any]) -> str:
    """A short human-readable report."""
    p = result["phase_seconds"]
    verdict = "meets" if result["within_target"] else "MISSES"
    return (
        f"{result['steps']} steps, generate {p['generate']:g}s, score {p['score']:g}s, train "
        f"{p['train']:g}s per step (simulated engines, real commit gate):\n"
        f"  sync  {result['sync']['steps_per_s']:.2f} steps/s\n"
        f"  async {result['async']['steps_per_s']:.2f} steps/s (max_staleness "
        f"{result['max_staleness']}, seen {result['max_staleness_seen']}; idle "
        f"{result['async']['idle_ratio_steady']})\n"
        f"  async_vs_sync {result['async_vs_sync']:.2f}x ({verdict} the {result['target']:g}x "
        "target)\n"
        f"  defer layout (the judge takes turns with the policy; only training overlaps): "
        f"async_vs_sync {result['defer']['async_vs_sync']:.2f}x (ideal "
        f"{result['defer']['ideal']:.2f}x)"
    )
