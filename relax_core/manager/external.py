"""External engines: a model served by engine heads Relax does not start, own or stop
(:class:`ExternalEngines`, in an :class:`~relax_core.manager.InferenceManager`'s place)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, NoReturn

import attrs

from relax_core._concurrent import each_in_thread
from relax_core._quote import quote_body
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.errors import CapabilityError
from relax_core.manager.publication import model_view, publish_model
from relax_core.manager.results import (
    HealthReport,
    LifecycleResult,
    Outcome,
    ReplicaHealth,
    ReplicaResult,
)
from relax_core.manager.worker import UPDATE_METHODS
from relax_core.records import RouterMembership

#: The manager's calls an external model refuses (:class:`~relax_core.errors.CapabilityError`).
REFUSED: tuple[str, ...] = ("onload", "offload", "recover", "scale_out", "scale_in")
REFUSED += ("load_checkpoint", *UPDATE_METHODS)


def _get(url: str, timeout: float) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            raw, status = resp.read(), int(resp.status)
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), int(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, quote_body(raw)


@attrs.define(eq=False)
class ExternalEngines:
    """The engines of one model, given by URL and not managed here: health is each head's
    ``GET /health_generate``, heads are published (and given to the router) like managed ones
    as ``{model_id}/external-{i}``, every call in :data:`REFUSED` raises, :meth:`shutdown` only
    stops publishing. Thread-safe; every method blocks.

    :param urls: each head's base URL (``http://host:port``).
    :param spec: the model's engine spec (role, weight source: published as for managed heads).
    :param publisher: where the model's schema-2 view goes (``None``: nowhere).
    :param route_mode: ``DIRECT`` or ``SGLANG_ROUTER`` (then give ``router_url`` and ``router``).
    :param health_timeout: seconds each ``health_generate`` may take."""

    model_id: str
    _given_urls: tuple[str, ...] = attrs.field(kw_only=True, alias="urls", converter=tuple)
    spec: InferenceEngineSpec = attrs.field(kw_only=True)
    served_model_name: str = attrs.field(kw_only=True)
    publisher: Any = attrs.field(default=None, kw_only=True)
    route_mode: str = attrs.field(default="DIRECT", kw_only=True)
    router_url: str | None = attrs.field(default=None, kw_only=True)
    router: RouterMembership | None = attrs.field(default=None, kw_only=True)
    health_timeout: float = attrs.field(default=15.0, kw_only=True)
    #: Engine id -> the head's base URL.
    urls: dict[str, str] = attrs.field(init=False)
    _lock: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    _states: dict[str, str] = attrs.field(init=False)
    _errors: dict[str, str] = attrs.field(factory=dict, init=False)
    _generation: dict[str, int] = attrs.field(init=False)
    # Engine id -> the generation last published (a head back from FAILED moves it).
    _published: dict[str, int] = attrs.field(factory=dict, init=False)
    _weight_version: str | None = attrs.field(default=None, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        if not self._given_urls:
            raise ValueError(f"model {self.model_id!r}: give at least one external engine URL")
        self.urls = {
            f"{self.model_id}/external-{i}": u.rstrip("/") for i, u in enumerate(self._given_urls)
        }
        self._states = dict.fromkeys(self.urls, "STARTING")
        self._generation = dict.fromkeys(self.urls, 0)

    def states(self) -> dict[str, str]:
        """Engine id -> state (``STARTING``, ``READY``, ``FAILED``, ``STOPPING``)."""
        with self._lock:
            return dict(self._states)

    def engine_pids(self) -> dict[str, list[int | None]]:
        """Engine id -> ``[]``: an external engine has no process here."""
        return {engine_id: [] for engine_id in self.urls}

    def unconfirmed_workers(self) -> list[Any]:
        """``[]``: no worker of an external engine is ours to clean up."""
        return []

    @property
    def weight_version(self) -> str | None:
        """The weight version the heads reported (``None`` for sources that publish none)."""
        return self._weight_version if self.spec.publishes_version else None

    def model_view(self) -> Any:
        """The model's schema-2 :class:`~relax_core.discovery.schema.ModelView`."""
        from relax_core.discovery.schema import EngineView

        with self._lock:
            states = set(self._states.values())
            state = next((s for s in ("READY", "STARTING", "STOPPING") if s in states), "FAILED")
            engines = [
                EngineView(
                    engine_id=engine_id,
                    base_url=url if self._states[engine_id] == "READY" else None,
                    state=self._states[engine_id],
                    direct_eligible=self._states[engine_id] == "READY",
                    generation=max(1, self._generation[engine_id]),
                )
                for engine_id, url in self.urls.items()
            ]
            return model_view(self, state, self.weight_version, self.served_model_name, engines)

    def start(self) -> LifecycleResult:
        """Check every head's ``health_generate`` at once; publish each READY or FAILED."""
        begin = time.monotonic()
        with self._lock:
            report = self._probe_all()
            results = tuple(
                ReplicaResult(
                    engine_id,
                    Outcome.DONE if self._states[engine_id] == "READY" else Outcome.FAILED,
                    self._states[engine_id],
                    error=report.get(engine_id),
                    seconds=time.monotonic() - begin,
                )
                for engine_id in self.urls
            )
            return LifecycleResult("start", self.model_id, results, time.monotonic() - begin)

    def health_check(self, *, recover: bool = True) -> HealthReport:
        """Check every head's ``health_generate``: one that fails is FAILED (unpublished URL,
        out of the router), one that answers again is READY (a new generation). ``recover``
        changes nothing: an external engine is never rebuilt here."""
        with self._lock:
            if self._closed:
                return HealthReport(self.model_id, ())
            report = self._probe_all()
            return HealthReport(
                self.model_id,
                tuple(
                    ReplicaHealth(
                        engine_id,
                        healthy=engine_id not in report,
                        state=self._states[engine_id],
                        action="failed" if engine_id in report else "none",
                        problems=(report[engine_id],) if engine_id in report else (),
                    )
                    for engine_id in self.urls
                ),
            )

    def shutdown(self) -> None:
        """Stop publishing the heads and take them out of the router; they keep running.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._states = dict.fromkeys(self.urls, "STOPPING")
            self._closed = True
            self._publish()

    def _refuse(self, operation: str) -> NoReturn:
        raise CapabilityError(
            f"model {self.model_id!r} is served by external engines "
            f"({', '.join(self.urls.values())}) that Relax does not manage: {operation} is "
            "refused. Drive those engines where they run, or serve the model with engines "
            "started here (drop external_urls)"
        )

    def _probe_all(self) -> dict[str, str]:
        """Probe every head at once; update states; publish; engine id -> problem."""
        answers: dict[str, tuple[int, Any]] = {}

        def probe(engine_id: str, url: str) -> None:
            answers[engine_id] = _get(url + "/health_generate", self.health_timeout)

        each_in_thread(probe, self.urls.items(), name="external")
        problems = {}
        for engine_id, url in self.urls.items():
            status, body = answers[engine_id]
            if status == 200:
                if self._states[engine_id] != "READY":
                    self._generation[engine_id] += 1
                self._states[engine_id] = "READY"
                self._errors.pop(engine_id, None)
            else:
                answer = quote_body(str(body))
                why = f"{url}/health_generate answered {status or 'nothing'}: {answer}"
                problems[engine_id] = why
                self._states[engine_id] = "FAILED"
                self._errors[engine_id] = why
        if self.spec.publishes_version and self._weight_version is None:
            for engine_id, url in self.urls.items():
                if self._states[engine_id] == "READY":
                    status, info = _get(url + "/model_info", self.health_timeout)
                    if status == 200 and isinstance(info, dict) and info.get("weight_version"):
                        self._weight_version = str(info["weight_version"])
                        break
        self._publish()
        return problems

    def _publish(self) -> None:
        if self.router is not None:
            self.router.sync({e: u for e, u in self.urls.items() if self._states[e] == "READY"})
        if self.publisher is None:
            return
        view = self.model_view()
        publish_model(self.publisher, self.model_id, view)
        for engine in view.engines:
            last = self._published.get(engine.engine_id)
            self.publisher.set_engine(
                self.model_id,
                engine.engine_id,
                base_url=self.urls[engine.engine_id],
                state=engine.state,
                direct_eligible=engine.direct_eligible,
                replaced=last is not None and last != engine.generation,
            )
            self._published[engine.engine_id] = engine.generation


def _refused(operation: str) -> Callable[..., NoReturn]:
    def method(self: ExternalEngines, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse(operation)

    method.__name__ = method.__qualname__ = operation
    method.__doc__ = "Refused: external engines are not managed here."
    return method


for _operation in REFUSED:
    setattr(ExternalEngines, _operation, _refused(_operation))
