"""What ``relax serve`` brings up on the job runtime: role services, health monitors, gateways,
and (defer layouts) a :class:`~relax_core.jobs.wake.WakeController`. See ``docs/serve.md``."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from relax_core.config import JobConfig
from relax_core.coordination.handles import LocalManagerHandle
from relax_core.coordination.residency import defer_slices, plan_residency
from relax_core.discovery.server import RegistryServer
from relax_core.discovery.status import fetch_health, render_snapshot
from relax_core.errors import LifecycleError, RelaxError, SnapshotError
from relax_core.gateway.handler import GatewayOptions
from relax_core.gateway.serving import RunningGateway, start_actor_gateway, start_thread_gateway
from relax_core.jobs.managers import build_role_service
from relax_core.jobs.phases import deferred_roles
from relax_core.jobs.roles import RoleService, health_printer
from relax_core.jobs.runtime import JobRuntime
from relax_core.jobs.teardown import Stop
from relax_core.jobs.wake import WakeController
from relax_core.manager import ReplicaPlacement
from relax_core.plugins import PluginManager

#: Why a deferred role's model sleeps for good under ``relax serve`` (a gateway in a Ray actor
#: cannot reach the wake controller), and what to do (its gateway's 503).
_SLEEPING_NOTE = (
    "a role sharing its GPUs has its gateway in a Ray actor (gateway.in_ray_actor), which "
    "cannot reach relax serve's wake controller, so nothing wakes the roles of those GPUs; run "
    "their gateways in relax serve's process (leave gateway.in_ray_actor unset) to have "
    "requests wake them, or leave the role out of placement.defer_roles and give it GPUs of "
    "its own"
)
#: Who wakes a deferred model, in its ``SLEEPING`` line.
_WAKES = "a request to its gateway wakes it (relax serve wakes deferred roles on demand)"


class ServedJob:
    """What :func:`serve_job` brought up: the job runtime, role services, gateways."""

    def __init__(self) -> None:
        self.runtime = JobRuntime()
        self.services: dict[str, RoleService] = {}
        self.gateways: dict[str, RunningGateway] = {}
        self.registry: RegistryServer | None = None
        self.wake: WakeController | None = None

    @property
    def bound(self) -> list[Any]:
        """The bound placement groups."""
        return self.runtime.bound

    def status(self) -> str:
        """A status table of every role, with engine pids."""
        pids = self.runtime.pids()
        tables = [render_snapshot(s.snapshot(), pids=pids) for s in self.services.values()]
        if self.wake is not None:
            tables.append(
                "residency (woken on demand)\n"
                + "\n".join(f"  {line}" for line in self.wake.summary())
            )
        return "\n".join(tables)


def place_served_job(
    config: JobConfig, pm: PluginManager, job: ServedJob, *, detach_groups: bool = False
) -> dict[str, dict[str, ReplicaPlacement]]:
    """Plan, create and bind the job's placement groups (``detach_groups``: detached); each
    model's placement by role. :raises PlacementError: the plan or a binding is invalid."""
    job.runtime.plan_for(config, pm)
    return job.runtime.bind(config, detach=detach_groups)


def teardown_served_job(job: ServedJob, out: TextIO) -> list[str]:
    """Take ``job`` down (:meth:`~relax_core.jobs.runtime.JobRuntime.teardown`): the health
    monitors, the gateways and their registry first; return what was left."""
    with contextlib.suppress(RelaxError):
        job.runtime.pids()  # engines rebuilt by the health monitor since the last status table
    first = []
    if job.wake is not None:
        first.append(Stop("wake controller", job.wake.stop))
    first += [Stop(f"{role} health monitor", s.stop_monitor) for role, s in job.services.items()]
    first += [
        Stop(f"{role} gateway ({gw.mode})", gw.stop, kind="gateways")
        for role, gw in job.gateways.items()
    ]
    if job.registry is not None:
        first.append(Stop("registry server", job.registry.stop))
    job.gateways, job.registry, job.wake = {}, None, None
    return job.runtime.teardown(lambda line: print(line, file=out, flush=True), first=first)


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
    detach_groups: bool = False,
) -> Iterator[ServedJob]:
    """Bring ``config``'s inference side up on the connected Ray; tear it all down on exit
    (every fenced placement group kept: ``job.runtime.kept_groups``).

    ``health_interval``: seconds between health checks (0: none). ``before_teardown``: called
    when the block ends or Ctrl-C interrupts the start. ``detach_groups``: detached groups.
    :raises PlacementError: the plan or the binding is invalid (nothing was started).
    :raises LifecycleError: engines did not become READY (everything started is shut down),
        or the shutdown left problems."""
    pm = plugin_manager or PluginManager.create()
    job = ServedJob()
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    hold = before_teardown or (lambda: None)
    failed = False
    try:
        placements = place_served_job(config, pm, job, detach_groups=detach_groups)
        for role in config.roles:
            service = build_role_service(
                role, plugin_manager=pm, placements=placements[role.name], log_dir=log_dir
            )
            job.services[role.name] = service
            for model in service.models():
                job.runtime.add(model)
        job.runtime.start(
            config,
            lambda line: print(line, file=out, flush=True),
            sleep_note=_WAKES
            if set(deferred_roles(config)) <= set(_shared(job, config))
            else (
                "nothing wakes it: a role of its GPUs has its gateway in a Ray actor "
                "(its gateway's 503 says what to do)"
            ),
            logs=log_dir,
            on_interrupt=hold,
            progress=lambda: _progress(job, config),
        )
        job.wake = _wake_controller(job, config, out)
        driven = set() if job.wake is None else set(job.wake.roles())
        if health_interval > 0:
            for name, service in job.services.items():
                # A role the wake controller drives is rebuilt by it, under its slice's lock
                # (a rebuilt engine comes up awake: never beside another role's models).
                service.start_monitor(
                    health_interval, recover=name not in driven, on_report=health_printer(name, out)
                )
        _start_gateways(job, config, pm, token)
        yield job
    except KeyboardInterrupt:
        raise  # an asked-for stop: a shutdown that leaves problems still raises below
    except BaseException:
        failed = True
        raise
    finally:
        hold()
        problems = teardown_served_job(job, out)
        if problems:
            message = "shutdown left problems:\n  " + "\n  ".join(problems)
            if not failed:
                raise LifecycleError(message)
            print(message, file=out, flush=True)


def _start_gateways(
    job: ServedJob, config: JobConfig, pm: PluginManager, token: str | None
) -> None:
    if any(role.gateway.in_ray_actor for role in config.roles):
        job.registry = RegistryServer(
            {name: service.snapshot for name, service in job.services.items()}
        ).start()
    deferred = deferred_roles(config)
    waker = None if job.wake is None else job.wake.waker()
    driven = set() if job.wake is None else set(job.wake.roles())
    for role in config.roles:
        service = job.services[role.name]
        # The same options whichever way the gateway runs. A deferred role nothing wakes (a
        # role of its slice has its gateway in a Ray actor) sleeps for good: its gateway must
        # not promise a wake-up.
        note = _SLEEPING_NOTE if role.name in deferred and role.name not in driven else None
        options = GatewayOptions(model_paths=service.model_paths, token=token, sleeping_note=note)
        host, port = role.gateway.host, role.gateway.port
        if role.gateway.in_ray_actor:
            assert job.registry is not None
            url = f"{job.registry.url}/{role.name}"
            gateway = start_actor_gateway(role.name, url, host=host, port=port, options=options)
        else:
            gateway = start_thread_gateway(
                role.name,
                service.snapshot,
                plugin_manager=pm,
                host=host,
                port=port,
                options=options,
                waker=waker,
            )
        job.gateways[role.name] = gateway
    deadline = time.monotonic() + 600  # "ready" once no role adapter is loading (tokenizers)
    for name, gw in job.gateways.items():
        while fetch_health(f"{gw.url}/{name}").get("adapter") == "loading":
            if time.monotonic() > deadline:
                raise LifecycleError(f"the {name} gateway's adapter still loads after 600 s")
            time.sleep(0.05)


def _shared(job: ServedJob, config: JobConfig) -> dict[str, str]:
    """Role -> slice of the roles woken on demand: those of a slice of GPUs several roles share
    in the plan, where no role's gateway runs in a Ray actor (it could not reach the
    controller)."""
    slices = dict(defer_slices(job.runtime.plan))
    members: dict[str, set[str]] = {}
    for role, sid in slices.items():
        members.setdefault(sid, set()).add(role)
    in_actor = {r.name for r in config.roles if r.gateway.in_ray_actor}
    return {
        role: sid
        for role, sid in slices.items()
        if len(members[sid]) > 1 and not in_actor & members[sid]
    }


def _wake_controller(job: ServedJob, config: JobConfig, out: TextIO) -> WakeController | None:
    """The wake controller of the job's shared slices, started (``None``: no deferred role
    shares GPUs with another role behind a gateway of this process)."""
    shared = _shared(job, config)
    deferred = set(deferred_roles(config))
    if not deferred & shared.keys():
        return None
    residency = plan_residency(
        job.runtime.plan, shared, mode=config.placement.residency, roles=tuple(shared)
    )
    roles = {
        role: (
            sid,
            [LocalManagerHandle(m.manager, name=m.key) for m in job.services[role].models()],
        )
        for role, sid in shared.items()
    }

    def say(line: str) -> None:
        print(f"residency: {line}", file=out, flush=True)

    controller = WakeController(
        roles,
        residency=residency,
        awake=[role for role in shared if role not in deferred],
        settings=config.serve,
        on_event=say,
    )
    for line in residency.describe():
        say(f"{line}; woken on demand")
    return controller.start()


def _progress(job: ServedJob, config: JobConfig) -> str:
    """``role.model STATE ready/engines`` of every model, from the role snapshots."""
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
            parts.append(f"{role.name}.{model.name} {state} {ready}/{model.placement.num_engines}")
    return ", ".join(parts)
