"""Where a deferred role's switch goes, hop by hop: one hf engine on a tiny model (CPU), its
manager in a Ray actor publishing to a registry actor, a coordinator actor granting the role;
``--cycles`` activate/deactivate pairs through ``relax run --measure``'s probe, then each hop's
median over the onloads and over the offloads (milliseconds).

    python tools/switch-hops.py [--cycles 30] [--json]

The hops are those of the switch report (docs/run.md, ``--measure``). Needs relax-hf and
relax-bench installed; starts and stops its own local Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from typing import Any


async def _cycles(coordinator: Any, probe: Any, cycles: int) -> None:
    from relax_core import LifecycleResult
    from relax_core.coordination import SinkReceipt

    measured = probe.coordinator(coordinator)
    for batch in range(cycles + 1):
        await coordinator.begin_batch(batch)
        # The generation role (none here) released the slice: an empty confirmation.
        await coordinator.acknowledge_rollout_offloaded(batch, LifecycleResult("offload", "-", ()))
        await measured.activate("genrm", f"on-{batch}", batch_id=batch)
        await measured.deactivate("genrm", f"off-{batch}", batch_id=batch)
        await coordinator.commit_batch(batch, SinkReceipt(f"train_{batch}", 0, True))


def _floors(actor: Any, coordinator: Any) -> dict[str, float]:
    """Median milliseconds of calls that do nothing over the switch's transports: a Ray call to
    the manager actor, one that fans out to the head over the control channel, one to the
    coordinator actor."""
    import time

    import ray

    def median_ms(call: Any) -> float:
        times = []
        for _ in range(50):
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
        return round(statistics.median(times) * 1e3, 2)

    return {
        "ray_manager": median_ms(lambda: ray.get(actor.states.remote())),
        "ray_manager_channel": median_ms(lambda: ray.get(actor.admission_states.remote())),
        "ray_coordinator": median_ms(lambda: ray.get(coordinator.actor.describe.remote())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="one JSON object, no table")
    args = parser.parse_args()

    import ray
    from ray.util.placement_group import placement_group
    from relax_hf.tiny import make_tiny_model

    from relax_core import (
        InferenceEngineSpec,
        ManagerTimeouts,
        ModelLaunch,
        PluginManager,
        ReplicaPlacement,
        RoutingSpec,
        keep_local_ray_on_loopback,
    )
    from relax_core.coordination import start_coordinator
    from relax_core.discovery.actor import start_registry_actor
    from relax_core.manager.actor import start_manager_actor

    keep_local_ray_on_loopback()
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    pm = PluginManager.create()
    model = str(make_tiny_model(tempfile.mkdtemp(prefix="switch-hops-") + "/judge"))
    group = placement_group([{"GPU": 1.0, "CPU": 0.01}], strategy="PACK")
    ray.get(group.ready(), timeout=120)
    registry = start_registry_actor("genrm", RoutingSpec(default_model="judge"))
    actor = start_manager_actor(
        "judge",
        spec=InferenceEngineSpec(role="genrm", weight_source=pm.weight_source("STATIC")),
        backend=pm.engine_backend("hf"),
        launch=ModelLaunch(model_path=model, served_model_name="judge"),
        placement=ReplicaPlacement(group, [[[0]]], ray_gpu_fraction=1.0),
        publisher=registry,
        timeouts=ManagerTimeouts(start=300.0),
    )
    coordinator = None
    try:
        ray.get(actor.start.remote(), timeout=300).raise_for_failures()
        ray.get(actor.offload.remote(), timeout=60).raise_for_failures()
        heads = [e.base_url for e in ray.get(actor.model_view.remote()).engines]
        coordinator = start_coordinator(
            "switch-hops",
            slices={"rollout": "s", "genrm": "s"},
            managers={"genrm": [("genrm.judge", actor)]},
            generation_role="rollout",
        )

        async def urls(role: str) -> list[str]:
            return heads

        probe = pm.run_probe("switching").start(
            heads=urls, generation_role="rollout", step_of=lambda d: 0
        )
        asyncio.run(_cycles(coordinator, probe, args.cycles))
        floors = _floors(actor, coordinator)
    finally:
        if coordinator is not None:
            coordinator.stop()
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.shutdown()
    out: dict[str, Any] = {"floors": floors}
    for direction in ("onload", "offload"):
        # The first cycle warms every path (its first switch also asks for failed replicas).
        rows = [s.hops for s in probe.switches[2:] if s.direction == direction]
        keys = list(dict.fromkeys(k for h in rows for k in h))
        out[direction] = {
            k: round(statistics.median(h[k] for h in rows if k in h) * 1e3, 2) for k in keys
        }
        out[direction]["n"] = len(rows)
    if args.json:
        print(json.dumps(out))
        return
    for direction, hops in out.items():
        print(f"{direction} (median ms of {hops.pop('n', 50)}):", file=sys.stdout)
        for key, ms in hops.items():
            print(f"  {key:20s} {ms:8.2f}")


if __name__ == "__main__":
    main()
