"""The one job runtime behind ``relax serve`` and ``relax run`` (``docs/jobs.md``)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from relax_core.config import JobConfig
from relax_core.jobs.models import ModelHandle
from relax_core.jobs.phases import put_to_sleep, start_models, start_order
from relax_core.jobs.pools import bind_pools, release_pools, replica_placements
from relax_core.jobs.teardown import Stop, shutdown_models, still_running, stop_parts
from relax_core.manager import LifecycleResult, ReplicaPlacement
from relax_core.plugins import PluginManager

#: Where a job's lines go (one line per call, without a newline).
Say = Callable[[str], None]


@attrs.define(eq=False)
class JobRuntime:
    """What one job brought up, and the one way to start it in phases and tear it down.
    Not thread-safe: one driver calls it."""

    #: role -> model id -> its handle, in the order added.
    models: dict[str, dict[str, ModelHandle]] = attrs.field(factory=dict)
    #: The placement plan the job was bound from.
    plan: Any = None
    #: The bound placement groups (``BoundPool``), in the order created.
    bound: list[Any] = attrs.field(factory=list)
    #: Every engine pid seen (checked gone after shutdown).
    engine_pids: set[int] = attrs.field(factory=set)
    #: Every router pid seen (checked gone after shutdown).
    router_pids: set[int] = attrs.field(factory=set)
    #: The placement groups teardown kept (name -> why): a worker may still hold their GPUs.
    kept_groups: dict[str, str] = attrs.field(factory=dict)
    #: When the job began (``time.monotonic()``): the lines' stamps count from it.
    began: float = attrs.field(factory=time.monotonic)
    released: bool = attrs.field(default=False, init=False)

    def line(self, say: Say, text: str) -> None:
        """``say`` one line of the job, stamped with the seconds since it began."""
        say(f"  [{time.monotonic() - self.began:5.1f}s] {text}")

    @property
    def handles(self) -> list[ModelHandle]:
        """Every model's handle, role by role."""
        return [m for models in self.models.values() for m in models.values()]

    @property
    def pools(self) -> dict[str, Any]:
        """Pool name -> its bound placement group."""
        return {b.pool: b for b in self.bound}

    # -- placement ---------------------------------------------------------------------------

    def plan_for(self, config: JobConfig, pm: PluginManager) -> Any:
        """Plan ``config``'s placement (pure), kept as :attr:`plan`.
        :raises PlacementError: the plan is invalid."""
        from relax_core.placement import plan_inference_placement

        self.plan = plan_inference_placement(config, pm)
        return self.plan

    def bind(
        self, config: JobConfig, *, detach: bool = False
    ) -> dict[str, dict[str, ReplicaPlacement]]:
        """Create and bind the placement group of every pool of :attr:`plan` (each in
        :attr:`bound` once it exists; ``detach``: detached); role -> model -> placement.
        :raises PlacementError: a pool's binding is invalid."""
        if self.plan is None:
            raise ValueError("bind() needs a plan: call plan_for() first")
        bound = bind_pools(self.plan, out=self.bound, detach=detach)
        return replica_placements(config, self.plan, bound)

    # -- models ------------------------------------------------------------------------------

    def add(self, model: ModelHandle) -> None:
        """Add a model's handle (built, not started). :raises ValueError: added twice."""
        models = self.models.setdefault(model.role, {})
        if model.model_id in models:
            raise ValueError(f"{model.key} was added twice")
        models[model.model_id] = model

    def track(self, model: ModelHandle) -> dict[str, list[int]]:
        """Record the model's engine and router pids (checked gone at teardown); engine id
        (and ``<model>/router``) -> its live pids."""
        out = {e: [p for p in pids if p] for e, pids in model.engine_pids().items()}
        routers = model.router_pids()
        self.engine_pids.update(p for pids in out.values() for p in pids)
        self.router_pids.update(routers)
        if routers:
            out[f"{model.model_id}/router"] = routers
        return out

    def pids(self) -> dict[str, list[int]]:
        """:meth:`track` of every model: engine id (and ``<model>/router``) -> its pids."""
        return {key: pids for model in self.handles for key, pids in self.track(model).items()}

    # -- start -------------------------------------------------------------------------------

    def start(
        self,
        config: JobConfig,
        say: Say,
        *,
        sleep_note: str,
        logs: str | None = None,
        on_interrupt: Callable[[], None] | None = None,
        progress: Callable[[], str] | None = None,
        on_started: Callable[[int, int], None] | None = None,
    ) -> None:
        """Start every model phase by phase (:func:`~relax_core.jobs.phases.start_order`), each
        deferred phase put to SLEEPING (its line ending in ``sleep_note``) before the next.
        ``progress()``: a line printed when it changes; ``on_started(done, total)``: starts
        ended so far; ``on_interrupt()``: at Ctrl-C (starts in flight finish first). Blocking.
        :raises LifecycleError: an engine did not become READY (``logs``: where their logs
            are), or a deferred model could not be put to sleep (call :meth:`teardown`)."""
        steps = start_order(config, self.plan) if self.plan is not None else []
        if not steps:
            steps = [(tuple(self.models), False)]
        total = sum(len(self.models.get(r, {})) for roles, _ in steps for r in roles)
        ended = [0]
        count = threading.Lock()
        started = on_started or (lambda done, total: None)
        started(0, total)
        stop = threading.Event()
        ticker = None
        if progress is not None:
            ticker = threading.Thread(
                target=self._progress, args=(progress, say, stop), daemon=True, name="progress"
            )
            ticker.start()

        def done(model: ModelHandle, outcome: LifecycleResult | BaseException) -> None:
            with contextlib.suppress(Exception):  # a dead actor: its start's error says so
                self.track(model)
            with count:
                ended[0] += 1
                started(ended[0], total)
            if isinstance(outcome, BaseException):
                self.line(say, f"{model.key}: FAILED: {outcome}")
            elif outcome.ok:
                self.line(say, f"{model.key}: READY")
            else:
                errors = "; ".join(f"{r.engine_id}: {r.error}" for r in outcome.failed)
                self.line(say, f"{model.key}: FAILED: {errors}")

        def interrupted() -> None:
            if on_interrupt is not None:
                on_interrupt()
            self.line(
                say, "interrupted: waiting for the engines being started, then shutting down …"
            )

        try:
            for roles, sleep in steps:
                models = [m for r in roles for m in self.models.get(r, {}).values()]
                what = "deferred, put to sleep once started" if sleep else "awake"
                self.line(say, f"starting {', '.join(m.key for m in models)} ({what})")
                start_models(models, on_done=done, on_interrupt=interrupted, logs=logs)
                if sleep:
                    for model in models:
                        slept = put_to_sleep(model)
                        how = "engine memory released, weights kept on the CPU"
                        if "weights" not in {t for r in slept.replicas for t in r.tags}:
                            how = "KV cache released, weights kept on the GPU"
                        self.line(say, f"{model.key}: SLEEPING (deferred: {how}; {sleep_note})")
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
        gc.collect()  # the start's objects stay out of full collections (0.05-0.3 s pauses
        gc.freeze()  # of this process each, docs/benchmarks.md) until teardown() puts them back

    def _progress(self, progress: Callable[[], str], say: Say, stop: threading.Event) -> None:
        last = ""
        while True:
            line = progress()
            if line != last:
                self.line(say, line)
                last = line
            if stop.wait(1.0):
                return

    # -- teardown ----------------------------------------------------------------------------

    def teardown(
        self, say: Say, *, first: Sequence[Stop] = (), then: Sequence[Stop] = ()
    ) -> list[str]:
        """Take the job down: ``first``, every model at once, ``then``, the check that every
        process seen is gone, then every placement group but the fenced ones. Returns what
        could not be confirmed (empty when clean); each part is tried. Idempotent."""
        gc.unfreeze()
        problems = stop_parts(first, lambda text: self.line(say, text))
        models = self.handles
        self.models = {}
        found, unconfirmed = shutdown_models(models)
        problems += found
        if models:
            self.line(say, f"managers stopped ({len(models)})")
        problems += stop_parts(then, lambda text: self.line(say, text))
        problems += still_running(self.engine_pids, self.router_pids)
        if models:
            self.line(say, f"engines stopped ({len(self.engine_pids)} processes)")
        if models and self.router_pids:
            self.line(say, f"routers stopped ({len(self.router_pids)})")
        if not self.released:
            self.released = True
            released = release_pools(
                self.bound, unconfirmed, kept=self.kept_groups, problems=problems
            )
            if self.bound:
                kept = f", {len(self.kept_groups)} kept" if self.kept_groups else ""
                self.line(say, f"placement groups removed ({released}){kept}")
        return problems
