"""``relax serve CONFIG``: bring a job's inference side up on Ray and serve its role gateways.

plan → placement groups → binding check → one role service (managers) per role → engines →
one gateway per role. It prints progress while engines start, then the gateway URLs and a live
status table; Ctrl-C (or SIGTERM) shuts everything down: gateways, engines, managers' actors,
placement groups, and the local Ray it started.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from relax_core.commands.status import render_snapshot
from relax_core.config import JobConfig, load_config
from relax_core.errors import RelaxError
from relax_core.gateway import InferenceGatewayHandler, adapter_for_role
from relax_core.gateway_app import GatewayServer, create_gateway_app
from relax_core.manager import ReplicaPlacement
from relax_core.plugins import PluginManager
from relax_core.service import RoleService, build_role_service

NAME = "serve"
HELP = "Bring a job's inference roles up on Ray and serve their gateways until Ctrl-C."

__all__ = ["ServedJob", "serve_job"]


class ServedJob:
    """What :func:`serve_job` brought up: role services, gateways and their URLs."""

    def __init__(self) -> None:
        self.services: dict[str, RoleService] = {}
        self.gateways: dict[str, GatewayServer] = {}
        self.bound: list[Any] = []

    @property
    def urls(self) -> dict[str, str]:
        """Role → gateway base URL (requests go to ``{url}/{role}/…``)."""
        return {role: gw.url for role, gw in self.gateways.items()}

    def status(self) -> str:
        """A status table of every role."""
        return "\n".join(render_snapshot(s.snapshot()) for s in self.services.values())


def _placements(config: JobConfig, pm: PluginManager, job: ServedJob) -> dict[str, dict[str, Any]]:
    """Plan, create and bind placement groups; each model's ReplicaPlacement by role."""
    from relax_core.placement import plan_inference_placement
    from relax_core.placement.binding import bind_placement_group

    plan = plan_inference_placement(config, pm)
    pools = {p.pool for p in plan.placements if p.pool is not None}
    bound = {}
    for pool in sorted(pools):
        bound[pool] = bind_placement_group(plan, pool, name=f"relax-{pool}")
        job.bound.append(bound[pool])
    out: dict[str, dict[str, Any]] = {}
    for role in config.roles:
        for model in role.models:
            mp = plan.model_placement(role.name, model.name)
            if mp.pool is None:
                placement = ReplicaPlacement.unplaced(model.num_engines)
            else:
                bm = bound[mp.pool].model(role.name, model.name)
                placement = ReplicaPlacement(
                    bound[mp.pool].placement_group,
                    tuple(tuple(w.bundles for w in rep) for rep in bm.replicas),
                    ray_gpu_fraction=float(mp.ray_gpu_fraction) or 1.0,
                    owned=False,
                )
            out.setdefault(role.name, {})[model.name] = placement
    return out


def _report(role: str, model_id: str, result: Any, out: TextIO) -> None:
    if getattr(result, "ok", False):
        print(f"  {role}.{model_id}: READY ({result.seconds:.1f}s)", file=out, flush=True)
    elif isinstance(result, BaseException):
        print(f"  {role}.{model_id}: FAILED: {result}", file=out, flush=True)
    else:
        errors = "; ".join(f"{r.engine_id}: {r.error}" for r in result.failed)
        print(f"  {role}.{model_id}: FAILED: {errors}", file=out, flush=True)


def _progress(job: ServedJob, out: TextIO, stop: threading.Event) -> None:
    last = ""
    while not stop.wait(1.0):
        parts = []
        for role, service in job.services.items():
            snap = service.snapshot()
            for model_id, model in snap.models.items():
                ready = sum(1 for e in model.engines if e.state.value == "READY")
                parts.append(f"{role}.{model_id} {model.state.value} {ready}/{len(model.engines)}")
        line = "  starting: " + ", ".join(parts)
        if line != last:
            print(line, file=out, flush=True)
            last = line


@contextlib.contextmanager
def serve_job(
    config: JobConfig,
    *,
    plugin_manager: PluginManager | None = None,
    token: str | None = None,
    out: TextIO = sys.stdout,
    log_dir: str | None = None,
) -> Iterator[ServedJob]:
    """Bring ``config``'s inference side up on the connected Ray; tear it all down on exit.

    :raises PlacementError: the plan or the binding is invalid (nothing was started).
    :raises LifecycleError: engines did not become READY (everything started is shut down).
    """
    pm = plugin_manager or PluginManager.create()
    job = ServedJob()
    if log_dir is not None:
        import os

        os.makedirs(log_dir, exist_ok=True)
    try:
        placements = _placements(config, pm, job)
        for role in config.roles:
            job.services[role.name] = build_role_service(
                role, plugin_manager=pm, placements=placements[role.name], log_dir=log_dir
            )
        stop = threading.Event()
        ticker = threading.Thread(target=_progress, args=(job, out, stop), daemon=True)
        ticker.start()
        errors: list[BaseException] = []

        def start(service: RoleService) -> None:
            try:
                role_name = service.role

                def done(model_id: str, result: Any) -> None:
                    _report(role_name, model_id, result, out)

                service.start(on_done=done)
            except BaseException as exc:
                errors.append(exc)

        starters = [threading.Thread(target=start, args=(s,)) for s in job.services.values()]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        stop.set()
        ticker.join()
        if errors:
            raise errors[0]
        for role in config.roles:
            service = job.services[role.name]
            handler = InferenceGatewayHandler(
                role.name,
                snapshot_provider=service.snapshot,
                adapter=adapter_for_role(pm, role.name),
                model_paths=service.model_paths,
                token=token,
            )
            gw = GatewayServer(create_gateway_app(handler), role.gateway.host, role.gateway.port)
            job.gateways[role.name] = gw.start()
        yield job
    finally:
        _teardown(job, out)


def _teardown(job: ServedJob, out: TextIO) -> None:
    from relax_core.placement.binding import release_bound_pool

    for gw in job.gateways.values():
        gw.stop()
    problems = []
    for service in job.services.values():
        problems += service.shutdown()
    for bound in job.bound:
        try:
            release_bound_pool(bound)
        except RelaxError as exc:
            problems.append(str(exc))
    if problems:
        print("shutdown left problems:\n  " + "\n  ".join(problems), file=out, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job's TOML file")
    parser.add_argument("--address", help="an existing Ray cluster (default: a local Ray)")
    parser.add_argument("--token", help="bearer token every gateway requires (default: none)")
    parser.add_argument("--refresh", type=float, default=5.0, help="status refresh, seconds")
    parser.add_argument("--log-dir", help="where engine logs go")


@contextlib.contextmanager
def ray_session(address: str | None, config: JobConfig) -> Iterator[None]:
    """Connect to ``address``, or start a local Ray with the config's GPUs; stop what we began."""
    import ray

    started = False
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            gpus = config.cluster.total_gpus
            ray.init(num_gpus=gpus, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ray_session(args.address, config):
        print(f"relax serve: bringing up {', '.join(config.role_names)} …", flush=True)
        try:
            with serve_job(config, token=args.token, log_dir=args.log_dir) as job:
                for role, url in job.urls.items():
                    print(
                        f"  {role:8} gateway  {url}/{role}/   (status: relax status {url}/{role})"
                    )
                try:
                    while not stop.is_set():
                        print(f"\n{time.strftime('%H:%M:%S')}\n{job.status()}", flush=True)
                        stop.wait(args.refresh)
                except KeyboardInterrupt:
                    pass
                print("relax serve: shutting down …", flush=True)
        except KeyboardInterrupt:
            print("relax serve: interrupted while starting; shutting down …", flush=True)
    print("relax serve: stopped; nothing left running", flush=True)
    return 0
