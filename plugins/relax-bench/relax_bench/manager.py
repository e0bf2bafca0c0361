"""``relax bench manager``: parallel fan-out and own overhead of the InferenceManager.

16 logical replicas (one engine worker actor and one engine server process each, on a real
local Ray with fake GPUs) are offloaded and onloaded:

- ``slowest_single_s``: offload + onload of each replica alone (the better of two), the
  slowest of them;
- ``parallel_s``: offload + onload of all 16 at once (median of the repetitions);
- ``fanout_vs_slowest`` = ``parallel_s / slowest_single_s`` (parallel fan-out: <= 1.25);
- ``overhead_ms``: the manager's own time per operation — its wall time minus the slowest
  replica's time inside its worker (transport, bookkeeping, publishing), median (<= 20 ms);
  the operations go over each head's private control channel (HTTP), and
  ``transport_floor_ms`` is a no-op (``admission_states()``) over the same channel;
- ``ray_overhead_ms`` / ``ray_fanout_floor_ms``: the same operations and the same no-op sent as
  Ray actor calls instead (``control_channel=False``), interleaved with the channel's in the
  same run, for comparison.

Engines: by default the lightweight SGLang-protocol server of :mod:`._sim_engine` (real
processes, real HTTP through the admission and control paths), whose release and resume take
a fixed time per tag, as a GPU engine's do: 16 transformers processes on a 2-core machine would
measure CPU contention, not the manager. ``RELAX_BENCH_MANAGER_ENGINE=hf`` with
``RELAX_BENCH_MANAGER_MODEL=DIR`` uses the ``hf`` backend instead (for a machine with the cores
or GPUs for it); ``RELAX_BENCH_MANAGER_REPLICAS`` changes the count.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from typing import Any

from relax_core import ControlClient, EngineBackend, EngineLaunchSpec, SubprocessEngineProcess

__all__ = ["SIM_BACKEND", "format_result", "launch_sim", "run"]

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sim_engine.py")


def launch_sim(spec: EngineLaunchSpec) -> SubprocessEngineProcess:
    """Start one simulated engine server (a head needs ``port``; a follower serves no HTTP)."""
    argv = [sys.executable, _SCRIPT, "--host", spec.host, "--port", str(spec.port)]
    argv += ["--engine-id", spec.engine_id, "--nnodes", str(spec.nnodes)]
    argv += ["--node-rank", str(spec.node_rank)]
    if spec.dist_init_addr:
        argv += ["--dist-init-addr", spec.dist_init_addr]
    head = spec.node_rank == 0
    return SubprocessEngineProcess.start(
        [*argv, *spec.options.extra_args],
        base_url=f"http://{spec.host}:{spec.port}" if head else None,
        engine_id=spec.engine_id,
        log_path=spec.log_path,
    )


SIM_BACKEND = EngineBackend(
    name="bench-sim",
    launch=launch_sim,
    control_client=ControlClient,
    devices={"cpu"},
    multi_node=True,
    description="Benchmark engine: SGLang control protocol, timed release/resume, no model.",
)


def _backend() -> tuple[EngineBackend, str]:
    engine = os.environ.get("RELAX_BENCH_MANAGER_ENGINE", "sim")
    if engine == "sim":
        return SIM_BACKEND, "sim"
    from relax_core import PluginManager

    model = os.environ.get("RELAX_BENCH_MANAGER_MODEL")
    if not model:
        raise SystemExit(
            f"RELAX_BENCH_MANAGER_ENGINE={engine}: set RELAX_BENCH_MANAGER_MODEL to a checkpoint "
            "directory (e.g. one made by `relax-hf make-tiny-model DIR`)"
        )
    return PluginManager.create().engine_backend(engine), model


def run(quick: bool = False) -> dict[str, Any]:
    """Start the replicas, measure, shut everything down; return the numbers."""
    # Ray prints raylet warnings on stdout; keep stdout for the result alone.
    with contextlib.redirect_stdout(sys.stderr):
        return _run(quick)


def _floor(manager: Any) -> float:
    """Seconds of one no-op call fanned out to every replica's head (the transport's cost)."""
    begin = time.monotonic()
    states = manager.admission_states()
    took = time.monotonic() - begin
    bad = {e: s for e, s in states.items() if "error" in s}
    if bad:
        raise RuntimeError(f"no-op fan-out failed: {bad}")
    return took


def _cycle(manager: Any) -> tuple[float, list[float], float, float]:
    """One offload + onload of every replica: wall seconds, the two overheads, the two times."""
    begin = time.monotonic()
    off = manager.offload().raise_for_failures()
    on = manager.onload().raise_for_failures()
    wall = time.monotonic() - begin
    overheads = [r.seconds - max(x.seconds for x in r.replicas) for r in (off, on)]
    return wall, overheads, off.seconds, on.seconds


def _run(quick: bool) -> dict[str, Any]:
    import ray
    from ray.util.placement_group import placement_group

    from relax_core import (
        InferenceEngineSpec,
        InferenceManager,
        ManagerTimeouts,
        ModelLaunch,
        PluginManager,
        ReplicaPlacement,
    )

    replicas = int(os.environ.get("RELAX_BENCH_MANAGER_REPLICAS", "16"))
    repetitions = 3 if quick else 9
    backend, model = _backend()
    started_ray = not ray.is_initialized()
    if started_ray:
        from relax_core import keep_local_ray_on_loopback

        keep_local_ray_on_loopback()
        # A new local Ray, never a cluster someone started on this machine (``ray start``).
        ray.init(
            address="local",
            num_cpus=4,
            num_gpus=replicas,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    group = placement_group([{"GPU": 1.0, "CPU": 0.01}] * replicas, strategy="PACK")
    ray.get(group.ready(), timeout=120)
    static = PluginManager.create().weight_source("STATIC")
    manager = InferenceManager(
        "bench",
        spec=InferenceEngineSpec(role="bench", weight_source=static),
        backend=backend,
        launch=ModelLaunch(model_path=model, served_model_name="bench"),
        placement=ReplicaPlacement(
            group, [[[i]] for i in range(replicas)], ray_gpu_fraction=1.0, owned=True
        ),
        timeouts=ManagerTimeouts(start=300.0),
    )
    try:
        start = time.monotonic()
        manager.start().raise_for_failures()
        start_s = time.monotonic() - start
        manager.offload().raise_for_failures()  # warm every path once
        manager.onload().raise_for_failures()
        singles = []
        for engine_id in manager.states():
            # Each replica's own time: the better of two, so one scheduling hiccup of a busy
            # host does not become "the slowest replica" (the parallel time is a median).
            alone = []
            for _ in range(2):
                begin = time.monotonic()
                manager.offload(engine_ids=[engine_id]).raise_for_failures()
                manager.onload(engine_ids=[engine_id]).raise_for_failures()
                alone.append(time.monotonic() - begin)
            singles.append(min(alone))
        parallel, overheads, offloads, onloads = [], [], [], []
        floors, ray_floors, ray_overheads = [], [], []
        # The channel and the Ray transport take turns, so both see the same machine load.
        for _ in range(repetitions):
            manager.control_channel = True
            floors += [_floor(manager), _floor(manager)]
            wall, over, off_s, on_s = _cycle(manager)
            parallel.append(wall)
            overheads += over
            offloads.append(off_s)
            onloads.append(on_s)
            manager.control_channel = False
            ray_floors += [_floor(manager), _floor(manager)]
            ray_overheads += _cycle(manager)[1]
        manager.control_channel = True
        load = os.getloadavg()[0]
    finally:
        manager.shutdown()
        if started_ray:
            ray.shutdown()
    slowest = max(singles)
    ratio = statistics.median(parallel) / slowest
    overhead_ms = statistics.median(overheads) * 1000.0
    return {
        "replicas": replicas,
        "fanout_vs_slowest": round(ratio, 3),
        "overhead_ms": round(overhead_ms, 2),
        "slowest_single_s": round(slowest, 4),
        "parallel_s": round(statistics.median(parallel), 4),
        "offload_s": round(statistics.median(offloads), 4),
        "onload_s": round(statistics.median(onloads), 4),
        "overhead_ms_max": round(max(overheads) * 1000.0, 2),
        "transport_floor_ms": round(statistics.median(floors) * 1000.0, 2),
        "ray_overhead_ms": round(statistics.median(ray_overheads) * 1000.0, 2),
        "ray_fanout_floor_ms": round(statistics.median(ray_floors) * 1000.0, 2),
        "transport": "http",
        "load_avg_1m": round(load, 2),
        "start_s": round(start_s, 2),
        "repetitions": repetitions,
        "engine": "sim" if backend is SIM_BACKEND else backend.name,
        "ok": ratio <= 1.25 and overhead_ms <= 20.0,
    }


def format_result(result: dict[str, Any]) -> str:
    """A short human summary."""
    return (
        f"{result['replicas']} replicas ({result['engine']} engines): offload+onload of all "
        f"{result['parallel_s']:.3f}s vs slowest single {result['slowest_single_s']:.3f}s -> "
        f"{result['fanout_vs_slowest']:.2f}x (limit 1.25); manager overhead "
        f"{result['overhead_ms']:.1f} ms/op (max {result['overhead_ms_max']:.1f}, limit 20; a "
        f"no-op over the control channel costs {result['transport_floor_ms']:.1f} ms); as Ray "
        f"actor calls {result['ray_overhead_ms']:.1f} ms/op (no-op "
        f"{result['ray_fanout_floor_ms']:.1f} ms); load {result['load_avg_1m']:.1f}; "
        f"{'OK' if result['ok'] else 'OVER LIMIT'}"
    )
