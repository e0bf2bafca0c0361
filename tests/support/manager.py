"""Helpers for the InferenceManager tests: tiny models, managers on real Ray with hf engines,
process checks and the "nothing left behind" assertion.

Loaded by path from the ``tests/test_manager_*.py`` modules (the suite runs with
``--import-mode=importlib``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from relax_core.engine.spec import InferenceEngineSpec
from relax_core.errors import InferenceRecoveryRequired, LifecycleError
from relax_core.manager import InferenceManager, ManagerTimeouts, ModelLaunch, ReplicaPlacement
from relax_core.manager.worker import EngineWorker
from relax_core.plugins import PluginManager
from relax_core.records import EngineBackend, EngineLaunchSpec
from relax_core.testing import wait_for

_MODELS: dict[str, str] = {}
_MODELS_LOCK = threading.Lock()

#: Short deadlines: a test never waits long for a fault to be noticed.
FAST = ManagerTimeouts(
    start=120.0, offload=20.0, onload=30.0, drain=10.0, update=60.0, health=10.0, shutdown=10.0
)


def bare_worker(pm: PluginManager, launch: Callable[[EngineLaunchSpec], Any]) -> EngineWorker:
    """The worker of a STATIC genrm engine ``judge/replica-0`` of a backend named ``bare`` that
    starts it with ``launch`` and has no control client."""
    return EngineWorker(
        engine_id="judge/replica-0",
        node_rank=0,
        backend=EngineBackend(name="bare", launch=launch, control_client=lambda url: None),
        spec=InferenceEngineSpec(role="genrm", weight_source=pm.weight_source("STATIC")),
    )


def tiny_model(name: str = "micro") -> str:
    """A tiny hf checkpoint made locally once per process (no hub)."""
    with _MODELS_LOCK:
        if name not in _MODELS:
            from relax_hf.tiny import make_tiny_model

            root = tempfile.mkdtemp(prefix=f"relax-manager-test-{name}-")
            _MODELS[name] = str(make_tiny_model(os.path.join(root, "model"), size="micro"))
        return _MODELS[name]


def plugins() -> PluginManager:
    """A fresh plugin manager with the installed plugins (the hf backend among them)."""
    return PluginManager.create()


def placement_group(bundles: int) -> Any:
    """A Ray placement group of ``bundles`` one-fake-GPU bundles, ready."""
    import ray
    from ray.util.placement_group import placement_group as make

    group = make([{"GPU": 1.0, "CPU": 0.01}] * bundles, strategy="PACK")
    ray.get(group.ready(), timeout=60)
    return group


def make_manager(
    *,
    model_id: str = "judge",
    role: str = "genrm",
    source: str = "STATIC",
    replicas: int = 1,
    timeouts: ManagerTimeouts = FAST,
    publisher: Any = None,
    owned: bool = True,
    group: Any = None,
    model_path: str | None = None,
    unhealthy_after: int = 3,
    **spec: Any,
) -> InferenceManager:
    """A manager of ``replicas`` one-node hf replicas, each on its own fake-GPU bundle."""
    pm = plugins()
    group = group if group is not None else placement_group(replicas)
    return InferenceManager(
        model_id,
        spec=InferenceEngineSpec(role=role, weight_source=pm.weight_source(source), **spec),
        backend=pm.engine_backend("hf"),
        launch=ModelLaunch(model_path=model_path or tiny_model(), served_model_name=model_id),
        placement=ReplicaPlacement(
            group, [[[i]] for i in range(replicas)], ray_gpu_fraction=1.0, owned=owned
        ),
        publisher=publisher,
        timeouts=timeouts,
        unhealthy_after=unhealthy_after,
    )


# -- processes --------------------------------------------------------------------------------


def pid_alive(pid: int | None) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def signal_quietly(pid: int | None, sig: signal.Signals) -> None:
    """Send ``sig`` to ``pid`` if it still runs."""
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)  # type: ignore[arg-type]


def all_pids(manager: InferenceManager) -> list[int]:
    """Every engine pid the manager knows of."""
    return [p for pids in manager.engine_pids().values() for p in pids if p]


def actor_ids(manager: InferenceManager) -> set[str]:
    """The ids of the worker actors the manager holds now."""
    return {
        w.actor._actor_id.hex()
        for engine_id in manager.states()
        for w in manager.workers(engine_id)
        if w.actor is not None
    }


def alive_worker_actors(ids: set[str] | None = None) -> list[dict[str, Any]]:
    """Live EngineWorker actors (of ``ids`` only, when given).

    The public ``ray.util.state`` API needs the dashboard, which the test Ray runs without;
    the GCS view below is the same data.
    """
    import ray._private.state as ray_state

    return [
        a
        for a in ray_state.actors().values()
        if a.get("ActorClassName") == "EngineWorker"
        and a.get("State") != "DEAD"
        and (ids is None or a.get("ActorID") in ids)
    ]


def group_state(group: Any) -> str:
    """The placement group's state in the GCS (``CREATED``, ``REMOVED``, …)."""
    import ray

    return str(ray.util.placement_group_table(group)["state"])


def assert_nothing_left(pids: list[int], actors: set[str], groups: list[Any]) -> None:
    """No engine process, worker actor or placement group of a test is left behind."""
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=20, what=f"engines {pids} gone")
    wait_for(lambda: not alive_worker_actors(actors), timeout=20, what="worker actors dead")
    for group in groups:
        wait_for(lambda g=group: group_state(g) == "REMOVED", timeout=20, what="group removed")


def force_cleanup(manager: InferenceManager, stopped: list[int]) -> None:
    """Finalizer: shut the manager down whatever a test did to it.

    Continues processes a test stopped, and — only for processes this test started — confirms
    the cleanup of fenced workers after killing their engines itself.
    """
    for pid in stopped:
        signal_quietly(pid, signal.SIGCONT)
    for _ in range(3):
        try:
            manager.shutdown()
            return
        except InferenceRecoveryRequired:
            for pid in all_pids(manager):
                signal_quietly(pid, signal.SIGKILL)
            wait_for(
                lambda: not any(pid_alive(p) for p in all_pids(manager)),
                timeout=20,
                what="fenced engines gone",
            )
            manager.confirm_external_cleanup()
        except LifecycleError:
            time.sleep(0.5)
    manager.shutdown()


# -- HTTP ------------------------------------------------------------------------------------


def http(
    method: str, url: str, body: Any = None, *, timeout: float = 60.0
) -> tuple[int, Any, dict[str, str]]:
    """One blocking JSON request: (status, parsed body, headers)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text, status, headers = resp.read().decode(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        text, status, headers = exc.read().decode(), exc.code, dict(exc.headers)
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = text
    return status, parsed, headers


def generate(url: str, tokens: int = 4, **params: Any) -> tuple[int, Any, dict[str, str]]:
    """POST /generate with a short prompt (``params`` go into ``sampling_params``)."""
    sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True, **params}
    return http("POST", url + "/generate", {"text": "hello", "sampling_params": sampling})


class Run:
    """A started manager and every engine pid it ever had (checked dead at the end)."""

    def __init__(self, manager: InferenceManager) -> None:
        self.manager = manager
        self.pids: set[int] = set()
        self.actors: set[str] = set()
        self.groups = manager._groups.owned()

    def track(self) -> list[int]:
        """Record the manager's current engine pids; return them."""
        current = all_pids(self.manager)
        self.pids.update(current)
        self.actors.update(actor_ids(self.manager))
        return current


@contextlib.contextmanager
def managed(manager: InferenceManager, *, start: bool = True) -> Iterator[Run]:
    """Start ``manager``; always shut it down and check nothing is left behind."""
    run = Run(manager)
    try:
        if start:
            manager.start()
        run.track()
        yield run
    finally:
        run.track()
        force_cleanup(manager, sorted(run.pids))
        assert_nothing_left(sorted(run.pids), run.actors, run.groups)


def admission_inflight(manager: InferenceManager, engine_id: str) -> int:
    """Generation requests in flight at a replica's admission server."""
    import ray

    head = manager.workers(engine_id)[0]
    return int(ray.get(head.actor.admission_state.remote(), timeout=10)["inflight"])
