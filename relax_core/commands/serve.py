"""``relax serve CONFIG``: bring a job's inference side up on Ray and serve its role gateways.

Before anything starts: the config is parsed, the placement is planned and what ``relax serve``
cannot run is found (every problem is printed; exit status 2, no Ray, no engine). Then:
placement groups → binding check → one role service (managers) per role → engines (progress
is printed while they start) → one gateway per role (a thread of this process, or a CPU-only
Ray actor with ``[roles.X.gateway] in_ray_actor = true``) → the gateway URLs and a status table
that is printed again whenever it changes. A health monitor checks every replica every
``--health-interval`` seconds: a dead engine's replica is FAILED (no longer routed to) and
rebuilt. Ctrl-C (or SIGTERM) shuts everything down: gateways, engines, the managers' actors,
placement groups and the local Ray this command started; it exits 0 when nothing is left.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from relax_core.commands.status import render_snapshot
from relax_core.config import STANDARD_ROLES, ConfigValidationError, JobConfig, load_config
from relax_core.errors import LifecycleError, RelaxError, SnapshotError
from relax_core.manager import ReplicaPlacement
from relax_core.plugins import PluginManager
from relax_core.role_gateway import (
    RegistryServer,
    RunningGateway,
    start_actor_gateway,
    start_thread_gateway,
)
from relax_core.service import RoleService, build_role_service, servable_problems

NAME = "serve"
HELP = "Bring a job's inference roles up on Ray and serve their gateways until Ctrl-C."

__all__ = ["ServedJob", "ShutdownSignals", "check_job", "describe_job", "ray_session", "serve_job"]


class ServedJob:
    """What :func:`serve_job` brought up: role services, gateways and their URLs."""

    def __init__(self) -> None:
        self.services: dict[str, RoleService] = {}
        self.gateways: dict[str, RunningGateway] = {}
        self.bound: list[Any] = []
        self.registry: RegistryServer | None = None
        #: Every engine pid seen (checked gone after shutdown).
        self.engine_pids: set[int] = set()

    @property
    def urls(self) -> dict[str, str]:
        """Role → gateway base URL (requests go to ``{url}/{role}/…``)."""
        return {role: gw.url for role, gw in self.gateways.items()}

    def pids(self) -> dict[str, list[int]]:
        """Engine id → engine process ids, over every role (recorded in :attr:`engine_pids`)."""
        out: dict[str, list[int]] = {}
        for service in self.services.values():
            out.update(service.engine_pids())
        self.engine_pids.update(p for pids in out.values() for p in pids)
        return out

    def status(self) -> str:
        """A status table of every role, with engine pids."""
        pids = self.pids()
        return "\n".join(render_snapshot(s.snapshot(), pids=pids) for s in self.services.values())


def check_job(config: JobConfig, plugin_manager: PluginManager) -> list[str]:
    """Every reason ``config`` cannot be served (placement violations and servability), each
    as ``key.path: [rule] message``; empty when it can. Pure: starts nothing."""
    from relax_core.placement import preflight

    result = preflight(config, plugin_manager)
    problems = [str(v) for v in result.violations] if result.plan is None else []
    return problems + [str(p) for p in servable_problems(config, plugin_manager)]


def _placements(config: JobConfig, pm: PluginManager, job: ServedJob) -> dict[str, dict[str, Any]]:
    """Plan, create and bind placement groups; each model's ReplicaPlacement by role."""
    from relax_core.placement import bind_placement_group, plan_inference_placement

    plan = plan_inference_placement(config, pm)
    pools = sorted({p.pool for p in plan.placements if p.pool is not None})
    bound = {}
    for pool in pools:
        bound[pool] = bind_placement_group(plan, pool, name=f"relax-{pool}")
        job.bound.append(bound[pool])
    out: dict[str, dict[str, Any]] = {}
    for role in config.roles:
        for model in role.models:
            mp = plan.model_placement(role.name, model.name)
            if mp.pool is None:
                placement = ReplicaPlacement.unplaced(model.num_engines)
            else:
                placement = ReplicaPlacement.from_bound(
                    bound[mp.pool],
                    role.name,
                    model.name,
                    ray_gpu_fraction=float(mp.ray_gpu_fraction) or 1.0,
                )
            out.setdefault(role.name, {})[model.name] = placement
    return out


def describe_job(config: JobConfig, pm: PluginManager) -> list[str]:
    """One line per model: backend, device, engines, weight source, route mode, gateway mode."""
    lines = []
    for role in config.roles:
        spec = pm.role(role.name)
        for m in role.models:
            size = f"{m.num_engines} engine{'s' if m.num_engines != 1 else ''}"
            if m.device != "cpu":
                size += f" x {m.gpus_per_engine} GPU"
            where = "Ray actor" if role.gateway.in_ray_actor else "thread"
            lines.append(
                f"  {role.name}.{m.name}: {m.backend} on {m.device}, {size}, weights "
                f"{m.weight_source or spec.default_weight_source}, route "
                f"{m.route_mode or spec.default_route_mode}, gateway in a {where}"
            )
    return lines


def _report(role: str, model_id: str, result: Any, out: TextIO, began: float) -> None:
    at = f"[{time.monotonic() - began:5.1f}s]"
    if getattr(result, "ok", False):
        print(f"  {at} {role}.{model_id}: READY", file=out, flush=True)
    elif isinstance(result, BaseException):
        print(f"  {at} {role}.{model_id}: FAILED: {result}", file=out, flush=True)
    else:
        errors = "; ".join(f"{r.engine_id}: {r.error}" for r in result.failed)
        print(f"  {at} {role}.{model_id}: FAILED: {errors}", file=out, flush=True)


def _progress(
    job: ServedJob, config: JobConfig, out: TextIO, stop: threading.Event, began: float
) -> None:
    last = ""
    while True:
        parts = []
        for role in config.roles:
            try:
                models = job.services[role.name].snapshot().models
            except SnapshotError:
                models = {}  # no model has published yet
            for model in role.models:
                view = models.get(model.name)
                ready = sum(1 for e in view.engines if e.state.value == "READY") if view else 0
                state = view.state.value if view else "STARTING"
                parts.append(f"{role.name}.{model.name} {state} {ready}/{model.num_engines}")
        line = ", ".join(parts)
        if line != last:
            print(f"  [{time.monotonic() - began:5.1f}s] {line}", file=out, flush=True)
            last = line
        if stop.wait(1.0):
            return


def _health_event(role: str, out: TextIO) -> Callable[[str, Any], None]:
    def report(model_id: str, outcome: Any) -> None:
        stamp = time.strftime("%H:%M:%S")
        if isinstance(outcome, BaseException):
            print(f"{stamp} health {role}.{model_id}: {outcome}", file=out, flush=True)
            return
        for r in outcome.replicas:
            if not r.healthy:
                print(
                    f"{stamp} health {r.engine_id} ({role}): {'; '.join(r.problems)} → "
                    f"{r.action}, now {r.state}",
                    file=out,
                    flush=True,
                )

    return report


@contextlib.contextmanager
def serve_job(
    config: JobConfig,
    *,
    plugin_manager: PluginManager | None = None,
    token: str | None = None,
    out: TextIO = sys.stdout,
    log_dir: str | None = None,
    health_interval: float = 10.0,
    before_teardown: Callable[[], None] | None = None,
) -> Iterator[ServedJob]:
    """Bring ``config``'s inference side up on the connected Ray; tear it all down on exit.

    ``health_interval``: seconds between health checks of every replica (0: no monitor).
    ``before_teardown`` is called first thing when the block ends (e.g. to hold signals).

    :raises PlacementError: the plan or the binding is invalid (nothing was started).
    :raises LifecycleError: engines did not become READY (everything started is shut down).
    """
    pm = plugin_manager or PluginManager.create()
    job = ServedJob()
    if log_dir is not None:
        import os

        os.makedirs(log_dir, exist_ok=True)
    hold = before_teardown or (lambda: None)
    failed = False
    try:
        placements = _placements(config, pm, job)
        for role in config.roles:
            job.services[role.name] = build_role_service(
                role, plugin_manager=pm, placements=placements[role.name], log_dir=log_dir
            )
        _start_engines(job, config, out, hold)
        job.pids()
        if health_interval > 0:
            for name, service in job.services.items():
                service.start_monitor(health_interval, on_report=_health_event(name, out))
        _start_gateways(job, config, pm, token)
        yield job
    except KeyboardInterrupt:
        raise  # an asked-for stop: a shutdown that leaves problems still raises below
    except BaseException:
        failed = True
        raise
    finally:
        hold()
        problems = _teardown(job, out)
        if problems:
            message = "shutdown left problems:\n  " + "\n  ".join(problems)
            if not failed:
                raise LifecycleError(message)
            print(message, file=out, flush=True)


def _start_engines(
    job: ServedJob, config: JobConfig, out: TextIO, hold: Callable[[], None]
) -> None:
    began = time.monotonic()
    stop = threading.Event()
    ticker = threading.Thread(
        target=_progress, args=(job, config, out, stop, began), daemon=True, name="progress"
    )
    ticker.start()
    errors: list[BaseException] = []

    def start(service: RoleService) -> None:
        try:
            service.start(
                on_done=lambda model_id, result: _report(service.role, model_id, result, out, began)
            )
        except BaseException as exc:
            errors.append(exc)

    starters = [
        threading.Thread(target=start, args=(s,), daemon=True, name=f"start-{s.role}")
        for s in job.services.values()
    ]
    for t in starters:
        t.start()
    try:
        for t in starters:
            t.join()
    except KeyboardInterrupt:
        # A manager's shutdown() waits for its start() (one lock): let the starts finish.
        hold()
        print(
            "  interrupted: waiting for the engines being started, then shutting down …",
            file=out,
            flush=True,
        )
        for t in starters:
            t.join()
        raise
    finally:
        stop.set()
        ticker.join()
    if errors:
        raise errors[0]


def _start_gateways(
    job: ServedJob, config: JobConfig, pm: PluginManager, token: str | None
) -> None:
    if any(role.gateway.in_ray_actor for role in config.roles):
        job.registry = RegistryServer(
            {name: service.snapshot for name, service in job.services.items()}
        ).start()
    for role in config.roles:
        service = job.services[role.name]
        if role.gateway.in_ray_actor:
            assert job.registry is not None
            gateway = start_actor_gateway(
                role.name,
                f"{job.registry.url}/{role.name}",
                host=role.gateway.host,
                port=role.gateway.port,
                model_paths=service.model_paths,
                token=token,
            )
        else:
            gateway = start_thread_gateway(
                role.name,
                service.snapshot,
                plugin_manager=pm,
                host=role.gateway.host,
                port=role.gateway.port,
                model_paths=service.model_paths,
                token=token,
            )
        job.gateways[role.name] = gateway


def _teardown(job: ServedJob, out: TextIO) -> list[str]:
    """Gateways, then engines and managers, then placement groups; return what was left."""
    from relax_core.placement import release_bound_pool

    with contextlib.suppress(RelaxError):
        job.pids()
    problems = []
    for role, gw in job.gateways.items():
        try:
            gw.stop()
        except Exception as exc:
            problems.append(f"{role} gateway ({gw.mode}): {type(exc).__name__}: {exc}")
    if job.registry is not None:
        job.registry.stop()
    if job.gateways:
        print(f"  gateways stopped ({len(job.gateways)})", file=out, flush=True)
    for service in job.services.values():
        problems += service.shutdown()
    left = _wait_gone(job.engine_pids, timeout=15.0)
    if left:
        problems.append(f"engine processes still running: {sorted(left)}")
    if job.services:
        print(f"  engines stopped ({len(job.engine_pids)} processes)", file=out, flush=True)
    released = 0
    for bound in job.bound:
        try:
            released += release_bound_pool(bound)
        except RelaxError as exc:
            problems.append(str(exc))
    if job.bound:
        print(f"  placement groups removed ({released})", file=out, flush=True)
    return problems


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        import os

        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not sys.platform.startswith("linux")
    return state not in (b"Z", b"X")


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    left = {p for p in pids if _pid_alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if _pid_alive(p)}
    return left


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job's TOML file")
    parser.add_argument("--address", help="an existing Ray cluster (default: a new local Ray)")
    parser.add_argument("--token", help="bearer token every gateway requires (default: none)")
    parser.add_argument(
        "--refresh", type=float, default=2.0, help="seconds between status checks (default 2)"
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=10.0,
        help="seconds between health checks of every replica; 0 turns them off (default 10)",
    )
    parser.add_argument("--log-dir", help="where engine logs go (default: a new temp directory)")


@contextlib.contextmanager
def ray_session(address: str | None, config: JobConfig, out: TextIO = sys.stdout) -> Iterator[str]:
    """Connect to ``address``, or start a new local Ray declaring the config's GPUs (never
    an existing local cluster); yield a description; stop the Ray this call started."""
    import logging

    import ray

    started = False
    if ray.is_initialized():
        what = "the Ray this process is connected to"
    elif address:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        started, what = True, f"the Ray cluster at {address}"
    else:
        from relax_core.net import keep_local_ray_on_loopback

        keep_local_ray_on_loopback()
        gpus = config.cluster.total_gpus
        ray.init(
            address="local",
            num_gpus=gpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        started, what = True, f"a new local Ray ({gpus} GPUs declared)"
    try:
        yield what
    finally:
        if started:
            ray.shutdown()
            if not address:
                print("  local Ray stopped", file=out, flush=True)


class ShutdownSignals:
    """Ctrl-C and SIGTERM interrupt serving (KeyboardInterrupt); during shutdown they are
    held, because an interrupted shutdown would leave engines running."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.holding = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def hold(self) -> None:
        self.holding = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.holding:
            print("relax serve: still shutting down, please wait …", file=self.out, flush=True)
            return
        raise KeyboardInterrupt


def _reject(lines: list[str]) -> int:
    print(f"relax serve: rejected: {len(lines)} problem(s); nothing was started", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    pm = PluginManager.create()
    roles = dict.fromkeys([*STANDARD_ROLES, *pm.registered("roles")])
    try:
        config = load_config(args.config, role_names=roles)
    except ConfigValidationError as exc:
        return _reject([str(p) for p in exc.problems])
    problems = check_job(config, pm)
    if problems:
        return _reject(problems)
    signals = ShutdownSignals(out)
    signals.install()

    def stopping() -> None:
        if not signals.holding:
            signals.hold()
            print("relax serve: shutting down …", file=out, flush=True)

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="relax-serve-logs-")
    try:
        with ray_session(args.address, config, out) as where:
            print(f"relax serve: starting on {where}; engine logs in {log_dir}", flush=True)
            print("\n".join(describe_job(config, pm)), flush=True)
            with serve_job(
                config,
                plugin_manager=pm,
                token=args.token,
                out=out,
                log_dir=log_dir,
                health_interval=args.health_interval,
                before_teardown=stopping,
            ) as job:
                for role, gw in job.gateways.items():
                    print(
                        f"  {role:8} gateway  {gw.url}/{role}/   ({gw.mode}, pid {gw.pid}; "
                        f"relax status {gw.url}/{role})",
                        flush=True,
                    )
                print("relax serve: ready; Ctrl-C stops everything", flush=True)
                _watch(job, args.refresh, out)
    except KeyboardInterrupt:
        pass
    except LifecycleError as exc:
        print(f"relax serve: {exc}", file=sys.stderr, flush=True)
        return 1
    print("relax serve: stopped; nothing left running", flush=True)
    return 0


def _watch(job: ServedJob, refresh: float, out: TextIO) -> None:
    """Print the status table now and whenever it changes, until interrupted."""
    last = ""
    while True:
        table = job.status()
        if table != last:
            print(f"\nstatus at {time.strftime('%H:%M:%S')}\n{table}", file=out, flush=True)
            last = table
        time.sleep(refresh)
