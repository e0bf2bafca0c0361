"""The role service: one per inference role, its managers publishing into one
:class:`~relax_core.discovery.publisher.RegistryPublisher` (the role's snapshot), their routers,
and a periodic health monitor."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from typing import Any, TextIO

from relax_core._concurrent import each_in_thread
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoleSnapshot, RoutingSpec
from relax_core.errors import LifecycleError, RelaxError
from relax_core.jobs.models import LocalModel
from relax_core.jobs.phases import start_models
from relax_core.manager import HealthReport, InferenceManager
from relax_core.manager.external import ExternalEngines
from relax_core.records import RouterProcess

#: ``on_report(model_id, report_or_error)`` of :meth:`RoleService.start_monitor`.
MonitorCallback = Callable[[str, "HealthReport | BaseException"], None]


class RoleService:
    """The managers of one role's models and the role's registry (``weight_sources`` and
    ``static_roles`` go to its :class:`RegistryPublisher`). :meth:`snapshot` is thread-safe."""

    def __init__(
        self,
        role: str,
        routing: RoutingSpec,
        *,
        weight_sources: Any = None,
        static_roles: Collection[str] | None = None,
    ) -> None:
        self.role = role
        self.publisher = RegistryPublisher(
            role, routing, weight_sources=weight_sources, static_roles=static_roles
        )
        self.managers: dict[str, InferenceManager | ExternalEngines] = {}
        #: model id -> the router in front of its heads (SGLANG_ROUTER models)
        self.routers: dict[str, RouterProcess] = {}
        self.model_paths: dict[str, str] = {}
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()

    def add(
        self,
        model_id: str,
        manager: InferenceManager | ExternalEngines,
        *,
        model_path: str | None = None,
    ) -> None:
        """Add a model's manager (built with ``publisher=self.publisher``)."""
        if model_id in self.managers:
            raise ValueError(f"role {self.role!r} already has a model {model_id!r}")
        self.managers[model_id] = manager
        if model_path is not None:
            self.model_paths[model_id] = model_path

    def snapshot(self) -> RoleSnapshot:
        """The role's schema-2 snapshot, aggregated over every model."""
        return self.publisher.snapshot()

    def start(self) -> dict[str, Any]:
        """Start every model's engines in parallel, each behind its router; each model's
        ``LifecycleResult``. Blocking.
        :raises ConfigError: a router drops a request field the roles send.
        :raises LifecycleError: a router or some replica did not start (naming each), once
            every model has finished starting."""
        models = self.models()
        results = start_models(models)
        return {m.model_id: results[m.key] for m in models}

    def models(self) -> list[LocalModel]:
        """Every model as a :class:`~relax_core.jobs.models.LocalModel` (manager and router)."""
        return [
            LocalModel(self.role, m, manager, router=self.routers.get(m))  # type: ignore[abstract]
            for m, manager in self.managers.items()
        ]

    def engine_pids(self) -> dict[str, list[int]]:
        """Every live engine process id the managers know of, by engine id."""
        out: dict[str, list[int]] = {}
        for manager in self.managers.values():
            for engine_id, pids in manager.engine_pids().items():
                out[engine_id] = [p for p in pids if p]
        return out

    # -- health monitor --------------------------------------------------------------------

    def start_monitor(
        self, interval: float, *, recover: bool = True, on_report: MonitorCallback | None = None
    ) -> None:
        """Health-check every model (``health_check(recover=recover)``) and router every
        ``interval`` seconds in a daemon thread; ``on_report(model_id, report_or_error)`` hears
        each problem. Idempotent. :raises ValueError: ``interval`` is not positive."""
        if not interval > 0:
            raise ValueError(f"interval={interval!r}: give a positive number of seconds")
        if self._monitor is not None and self._monitor.is_alive():
            return
        self._monitor_stop.clear()
        self._monitor = threading.Thread(
            target=self._watch,
            args=(interval, recover, on_report),
            name=f"health-{self.role}",
            daemon=True,
        )
        self._monitor.start()

    def stop_monitor(self, timeout: float = 60.0) -> None:
        """Stop the health monitor; wait up to ``timeout`` for a check in progress. Idempotent."""
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout)
            self._monitor = None

    def _watch(self, interval: float, recover: bool, on_report: MonitorCallback | None) -> None:
        while not self._monitor_stop.wait(interval):
            # Every model at once: one model's slow probes (bounded by its health deadline)
            # must not delay the others' round.
            each_in_thread(
                self._check_one,
                [(m, manager, recover, on_report) for m, manager in list(self.managers.items())],
                name=f"health-{self.role}",
                daemon=True,
            )
            for model_id, router in list(self.routers.items()):
                if self._monitor_stop.is_set():
                    return
                trouble = router.check()  # restarts a dead router, retries registrations
                if trouble and on_report is not None:
                    on_report(
                        model_id, LifecycleError(f"router {router.url}: " + "; ".join(trouble))
                    )

    def _check_one(
        self, model_id: str, manager: Any, recover: bool, on_report: MonitorCallback | None
    ) -> None:
        if self._monitor_stop.is_set():
            return
        outcome: HealthReport | BaseException
        try:
            outcome = manager.health_check(recover=recover)
        except Exception as exc:  # reported, not swallowed: the monitor must go on
            outcome = exc
        failed = isinstance(outcome, BaseException) or not all(r.healthy for r in outcome.replicas)
        if failed and on_report is not None and not self._monitor_stop.is_set():
            on_report(model_id, outcome)

    def shutdown(self) -> list[str]:
        """Stop the monitor, shut every model down (each tried: its manager, then its
        router); return the problems, empty when clean."""
        self.stop_monitor()
        problems = []
        for model in self.models():
            try:
                model.shutdown()
            except RelaxError as exc:
                problems.append(f"{model.key}: {exc}")
        return problems

    def stop_routers(self, timeout: float = 3.0) -> None:
        """Stop every router (idempotent). They are stopped last, when no traffic is left, so
        a short grace is enough (smg would otherwise linger for its drain settle time)."""
        for router in self.routers.values():
            router.terminate(timeout)


def health_printer(role: str, out: TextIO) -> MonitorCallback:
    """An ``on_report`` for :meth:`RoleService.start_monitor` that prints one line per
    problem to ``out`` (``HH:MM:SS health <engine> (<role>): <problems> → <action>, now
    <state>``)."""

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
