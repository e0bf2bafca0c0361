"""sglang-router and smg as supervised router processes in front of one model's replica heads.

:class:`RouterServer` (what ``RouterBackend.launch`` returns; it implements
:class:`~relax_core.records.RouterProcess`):

- **starts** the router binary with the current interpreter (``python -m
  sglang_router.launch_router`` / ``python -m smg launch``: the ``smg`` console script is
  shadowed when both distributions are installed) on its own port and its own Prometheus port,
  with **retries and the circuit breaker disabled**: both routers otherwise replay a failed
  ``POST /generate`` on another worker, so a generation could run twice;
- **checks** at start that it serves, that it speaks the ``/workers`` API (``POST /workers
  {"url"}`` → ``worker_id``, ``DELETE /workers/{id}``; the old ``/add_worker`` answers 404 in
  both), and that every request field the roles send survives it (the field probe of
  :mod:`relax_sglang.fidelity`): a router that drops one is refused, naming the field and the
  router's version;
- **keeps the membership** the InferenceManager asks for (:meth:`RouterServer.sync`): a new head
  is registered and waited for until the router reports it healthy; a head that left is
  deleted and waited for until the router stops routing to it (smg keeps a deleted worker
  "draining" for a few seconds, unroutable);
- **supervises** (:meth:`RouterServer.check`, called by the role service's health monitor): a
  router that exited is restarted on the same ports and its heads registered again; failed
  registrations are retried; what is still wrong is returned.

In prefill/decode mode (``spec.pd``) each head registers as the kind its ``/server_info`` says
(``disaggregation_mode``), a prefill worker with its ``disaggregation_bootstrap_port``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import attrs

from relax_core import (
    ConfigError,
    LifecycleError,
    RouterBackend,
    RouterLaunchSpec,
    SubprocessEngineProcess,
    free_port,
)
from relax_sglang.fidelity import PROBES, ProbeServer, compare

__all__ = [
    "OWNED_ROUTER_FLAGS",
    "SGLANG_ROUTER",
    "SMG",
    "RouterKind",
    "RouterServer",
    "router_argv",
    "router_backend",
]

#: Router flags this plugin sets itself (``router_args`` may not): ports, policy, PD mode,
#: workers, and everything that could make the router replay a request.
OWNED_ROUTER_FLAGS = (
    "--host",
    "--port",
    "--policy",
    "--prometheus-host",
    "--prometheus-port",
    "--pd-disaggregation",
    "--worker-urls",
    "--prefill",
    "--decode",
    "--disable-retries",
    "--disable-circuit-breaker",
    "--retry-",
    "--cb-",
    "--health-check-interval-secs",
)


@attrs.frozen
class RouterKind:
    """One router binary: how to run it, what it supports, which distribution it comes from."""

    name: str
    distribution: str
    command: tuple[str, ...]
    policies: frozenset[str]
    default_policy: str
    keeps_unknown_fields: bool
    always: tuple[str, ...] = ()
    description: str = ""

    @property
    def version(self) -> str | None:
        """The installed version (``None``: not installed)."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None


SGLANG_ROUTER = RouterKind(
    name="sglang-router",
    distribution="sglang-router",
    command=("-m", "sglang_router.launch_router"),
    policies=frozenset({"random", "round_robin", "cache_aware", "power_of_two", "manual"}),
    default_policy="cache_aware",
    keeps_unknown_fields=False,
    description=(
        "SGLang's Rust router (0.3.x); drops request fields it does not know (its field probe "
        "refuses it unless router_allow_dropped_fields lists them); manual policy is sticky "
        "on X-SMG-Routing-Key."
    ),
)
SMG = RouterKind(
    name="smg",
    distribution="smg",
    command=("-m", "smg", "launch"),
    policies=frozenset(
        {
            "random",
            "round_robin",
            "passthrough",
            "cache_aware",
            "power_of_two",
            "least_load",
            "manual",
            "consistent_hashing",
            "prefix_hash",
        }
    ),
    default_policy="consistent_hashing",
    keeps_unknown_fields=True,
    # The router would otherwise try to fetch each model's tokenizer from a hub.
    always=("--disable-tokenizer-autoload",),
    description=(
        "SGLang Model Gateway (smg 1.x, sglang-router's successor); keeps unknown request "
        "fields; consistent_hashing is sticky on X-SMG-Routing-Key."
    ),
)


def router_argv(
    kind: RouterKind, spec: RouterLaunchSpec, port: int, metrics_port: int
) -> list[str]:
    """The router's command line (current interpreter, no PATH lookup).

    :raises ConfigError: ``router_args`` sets a flag this plugin owns, or the policy is not
        one the router supports.
    """
    if spec.policy not in kind.policies:
        raise ConfigError(
            f"{spec.router_id}.router_policy",
            f"router {kind.name!r} has no policy {spec.policy!r}; it supports "
            f"{', '.join(sorted(kind.policies))}",
        )
    for arg in spec.extra_args:
        flag = arg.split("=", 1)[0]
        if any(
            flag == own or (own.endswith("-") and flag.startswith(own))
            for own in OWNED_ROUTER_FLAGS
        ):
            raise ConfigError(
                f"{spec.router_id}.router_args",
                f"{flag} is set by the router plugin (ports, policy, PD mode, and retries and "
                "the circuit breaker stay disabled so no POST is ever replayed); remove it",
            )
    argv = [
        sys.executable,
        *kind.command,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--policy",
        spec.policy,
        "--prometheus-host",
        spec.host,
        "--prometheus-port",
        str(metrics_port),
        "--health-check-interval-secs",
        str(max(1, round(spec.health_check_interval))),
        "--log-level",
        "warn",
        *kind.always,
    ]
    if spec.pd:
        argv.append("--pd-disaggregation")
    # Last, so nothing before can turn them back on.
    return [*argv, *spec.extra_args, "--disable-retries", "--disable-circuit-breaker"]


def _http(method: str, url: str, body: Any = None, *, timeout: float) -> tuple[int, Any]:
    """One HTTP exchange: ``(status, parsed JSON or text)``; status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
            status = int(resp.status)
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), int(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text


class RouterServer:
    """One router process in front of one model's heads (see the module docstring).

    Built by :func:`router_backend`'s ``launch``: the process starts at once; call
    :meth:`wait_ready` before handing it to a manager. Thread-safe (one lock around the
    membership).

    :param register_timeout: seconds a new head may take until the router reports it healthy.
    :param remove_timeout: seconds a removed head may take until the router stops routing to it.
    :param call_timeout: seconds of each HTTP call to the router or a head.
    :raises ConfigError: the router is not installed, the policy or ``router_args`` are bad.
    """

    def __init__(
        self,
        kind: RouterKind,
        spec: RouterLaunchSpec,
        *,
        register_timeout: float = 60.0,
        remove_timeout: float = 30.0,
        call_timeout: float = 10.0,
    ) -> None:
        version = kind.version
        if version is None:
            raise ConfigError(
                f"{spec.router_id}.router",
                f"router {kind.name!r} is not installed; pip install {kind.distribution} (or "
                "choose another router)",
            )
        self.kind = kind
        self.spec = spec
        self.version = version
        self.register_timeout = register_timeout
        self.remove_timeout = remove_timeout
        self.call_timeout = call_timeout
        url_host = "127.0.0.1" if spec.host in ("0.0.0.0", "", "::") else spec.host
        self.port = spec.port or free_port(url_host)
        self.metrics_port = spec.metrics_port or free_port(url_host, avoid=(self.port,))
        self._url = f"http://{url_host}:{self.port}"
        self.argv = router_argv(kind, spec, self.port, self.metrics_port)
        self._lock = threading.RLock()
        #: engine id -> head URL, as the manager last asked
        self._desired: dict[str, str] = {}
        #: engine id -> (head URL, the router's worker id), registered and reported healthy
        self._workers: dict[str, tuple[str, str]] = {}
        #: engine id -> why it is not as desired
        self._problems: dict[str, str] = {}
        self.restarts = 0
        self._stopped = False
        self._process = self._spawn()

    def __repr__(self) -> str:
        return f"RouterServer({self.kind.name} {self.version}, {self._url}, {self.spec.router_id})"

    @property
    def name(self) -> str:
        """``<router> <version>`` (named in every error)."""
        return f"{self.kind.name} {self.version}"

    # -- RouterProcess -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Where callers send requests (the model's published ``router_url``)."""
        return self._url

    def pids(self) -> list[int]:
        """The router's process id while it runs."""
        return [self._process.pid] if self._process.poll() is None else []

    @property
    def log_path(self) -> str:
        """The router's log file."""
        return self._process.log_path

    def wait_ready(self, timeout: float) -> None:
        """Block until the router serves, speaks the ``/workers`` API and keeps every field.

        :raises LifecycleError: it exited, did not answer in time, or speaks another API.
        :raises ConfigError: it drops a request field the roles send (the message names each
            field and the router's version).
        """
        deadline = time.monotonic() + timeout
        self._process.wait_ready(timeout)
        self._check_api()
        self._probe_fields(deadline)

    def sync(self, heads: Mapping[str, str]) -> None:
        """Make the router's workers exactly ``heads`` (engine id → head URL); see
        :class:`~relax_core.records.RouterMembership`. Never raises: what fails is kept and
        returned by :meth:`check`."""
        with self._lock:
            self._desired = dict(heads)
            self._reconcile()

    def check(self) -> list[str]:
        """Restart the router if it exited, retry what is not as desired; return problems."""
        with self._lock:
            if self._stopped:
                return []
            problems = []
            code = self._process.poll()
            if code is not None:
                problems.append(
                    f"router {self.name} of {self.spec.router_id} exited with code {code} "
                    f"(log {self.log_path}); restarted it on {self._url}"
                )
                self._workers.clear()
                self._process = self._spawn()
                self.restarts += 1
                try:
                    self._process.wait_ready(self.register_timeout)
                    self._check_api()
                except (LifecycleError, ConfigError) as exc:
                    problems.append(str(exc))
                    return problems
            self._reconcile()
            problems += [f"{eid}: {why}" for eid, why in sorted(self._problems.items())]
            problems += self._unhealthy()
            return problems

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop the router (SIGTERM, SIGKILL after ``timeout``). Idempotent."""
        with self._lock:
            self._stopped = True
            self._process.terminate(timeout)

    def workers(self) -> dict[str, str]:
        """Engine id → the router's worker id, of every head registered now."""
        with self._lock:
            return {eid: wid for eid, (_, wid) in self._workers.items()}

    # -- the process -----------------------------------------------------------------------

    def _spawn(self) -> SubprocessEngineProcess:
        return SubprocessEngineProcess.start(
            self.argv,
            base_url=self._url,
            engine_id=f"router-{self.kind.name}-{self.spec.router_id}",
            env={"HF_HUB_OFFLINE": "1", **dict(self.spec.env)},
            log_path=self.spec.log_path,
            reaped=True,
        )

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return _http(method, self._url + path, body, timeout=self.call_timeout)

    def _check_api(self) -> None:
        status, answer = self._call("GET", "/workers")
        if status != 200 or not isinstance(answer, dict) or "workers" not in answer:
            raise LifecycleError(
                f"router {self.name} at {self._url} answers GET /workers with {status} "
                f"({str(answer)[:200]}): it does not speak the /workers API the router plugin "
                "registers heads through (sglang-router >= 0.3, smg >= 1.0); install one of those"
            )

    # -- membership ------------------------------------------------------------------------

    def _reconcile(self) -> None:
        for eid in list(self._workers):
            url, worker_id = self._workers[eid]
            if self._desired.get(eid) == url:
                continue
            error = self._deregister(worker_id, url)
            if error is None:
                del self._workers[eid]
                self._problems.pop(eid, None)
            else:
                self._problems[eid] = f"removal from router {self.name} not confirmed: {error}"
        for eid, url in self._desired.items():
            if eid in self._workers:
                continue
            try:
                worker_id = self._register(url, self._registration(url))
            except LifecycleError as exc:
                self._problems[eid] = str(exc)
                continue
            self._workers[eid] = (url, worker_id)
            self._problems.pop(eid, None)
        for eid in list(self._problems):
            if eid not in self._desired and eid not in self._workers:
                del self._problems[eid]

    def _registration(self, url: str) -> dict[str, Any]:
        body: dict[str, Any] = {"url": url}
        if not self.spec.pd:
            return body
        status, info = _http("GET", url + "/server_info", timeout=self.call_timeout)
        mode = info.get("disaggregation_mode") if isinstance(info, dict) else None
        if status != 200 or mode not in ("prefill", "decode"):
            raise LifecycleError(
                f"head {url} cannot join the prefill/decode router of {self.spec.router_id}: "
                f"its /server_info answered {status} with disaggregation_mode {mode!r} (want "
                "prefill or decode; is it an SGLang server started with --disaggregation-mode?)"
            )
        body["worker_type"] = mode
        if mode == "prefill":
            body["bootstrap_port"] = info.get("disaggregation_bootstrap_port")
        return body

    def _register(self, url: str, body: Mapping[str, Any]) -> str:
        """POST the worker, wait until the router reports it healthy; its worker id."""
        deadline = time.monotonic() + self.register_timeout
        while True:
            status, answer = self._call("POST", "/workers", dict(body))
            if status in (200, 201, 202) and isinstance(answer, dict) and answer.get("worker_id"):
                worker_id = str(answer["worker_id"])
                break
            # 409: the router still holds this URL (smg drains a deleted worker for a while).
            if status != 409 or time.monotonic() > deadline:
                raise LifecycleError(
                    f"router {self.name} refused to register head {url}: POST /workers answered "
                    f"{status} ({str(answer)[:300]})"
                )
            time.sleep(0.2)
        last: Any = None
        while time.monotonic() < deadline:
            status, last = self._call("GET", f"/workers/{worker_id}")
            if (
                status == 200
                and isinstance(last, dict)
                and last.get("is_healthy") is True
                and last.get("status", "ready") != "draining"
            ):
                return worker_id
            time.sleep(0.05)
        raise LifecycleError(
            f"router {self.name} took head {url} (worker {worker_id}) but did not report it "
            f"healthy within {self.register_timeout:.0f}s (last answer: {str(last)[:300]}); "
            f"see the router's log {self.log_path}"
        )

    def _deregister(self, worker_id: str, url: str) -> str | None:
        """DELETE the worker, wait until the router no longer routes to it; ``None`` when it
        is out, else why not."""
        status, answer = self._call("DELETE", f"/workers/{worker_id}")
        if status not in (200, 202, 204, 404):
            return f"DELETE /workers/{worker_id} ({url}) answered {status}: {str(answer)[:200]}"
        deadline = time.monotonic() + self.remove_timeout
        while True:
            status, answer = self._call("GET", f"/workers/{worker_id}")
            if status == 404:
                return None
            if (
                status == 200
                and isinstance(answer, dict)
                and (answer.get("is_healthy") is False or answer.get("status") == "draining")
            ):
                return None  # still listed while it drains, but never routed to again
            if time.monotonic() > deadline:
                return (
                    f"worker {worker_id} ({url}) still routable {self.remove_timeout:.0f}s after "
                    f"DELETE (GET answered {status}: {str(answer)[:200]})"
                )
            time.sleep(0.05)

    def _unhealthy(self) -> list[str]:
        status, answer = self._call("GET", "/workers")
        if status != 200 or not isinstance(answer, dict):
            return [f"router {self.name} at {self._url}: GET /workers answered {status}"]
        seen = {str(w.get("id")): w for w in answer.get("workers", []) if isinstance(w, dict)}
        out = []
        for eid, (url, worker_id) in sorted(self._workers.items()):
            worker = seen.get(worker_id)
            if worker is None:
                # Lost by the router (restarted by someone else?): register it again next time.
                del self._workers[eid]
                out.append(f"{eid}: router {self.name} no longer lists {url}; re-registering")
            elif worker.get("is_healthy") is False:
                out.append(f"{eid}: router {self.name} reports {url} unhealthy")
        return out

    # -- the field probe -------------------------------------------------------------------

    def _probe_fields(self, deadline: float) -> None:
        modes = ("prefill", "decode") if self.spec.pd else ("regular",)
        dropped: dict[str, str] = {}
        with ProbeServer(
            modes, served_model_name=self.spec.served_model_name, model_path=self.spec.model_path
        ) as probe:
            registered = []
            try:
                for url in probe.urls:
                    body: dict[str, Any] = {"url": url}
                    if self.spec.pd:
                        body["worker_type"] = probe.worker_type(url)
                        if body["worker_type"] == "prefill":
                            body["bootstrap_port"] = probe.bootstrap_port
                    registered.append((self._register(url, body), url))
                for probe_body in PROBES:
                    timeout = max(1.0, deadline - time.monotonic())
                    status, answer = _http(
                        "POST", self._url + "/generate", probe_body, timeout=timeout
                    )
                    if status != 200:
                        raise LifecycleError(
                            f"router {self.name}: the field probe POST /generate answered "
                            f"{status} ({str(answer)[:300]}); see the router's log {self.log_path}"
                        )
                    received = probe.received(probe_body["rid"])
                    for body_seen in received or [None]:
                        for path, why in compare(probe_body, body_seen).items():
                            dropped.setdefault(path, why)
                    if len(received) < len(modes):
                        dropped.setdefault("rid", "the request reached fewer workers than sent")
            finally:
                for worker_id, url in registered:
                    self._deregister(worker_id, url)
        refused = {p: why for p, why in dropped.items() if p not in self.spec.allow_dropped_fields}
        if refused:
            fields = ", ".join(f"{p} ({why})" for p, why in sorted(refused.items()))
            raise ConfigError(
                f"{self.spec.router_id}.router",
                f"router {self.name} does not forward request fields the roles send: {fields}. "
                "Use a router that keeps them (smg 1.13 keeps every field outside prefill/decode "
                "mode), or, if no caller of this model ever sends them, list them in "
                "router_allow_dropped_fields.",
            )


def router_backend(kind: RouterKind, *, default: bool = False) -> RouterBackend:
    """The :class:`~relax_core.records.RouterBackend` record of ``kind``."""
    return RouterBackend(
        name=kind.name,
        launch=functools.partial(RouterServer, kind),
        policies=kind.policies,
        default_policy=kind.default_policy,
        worker_api="workers",
        keeps_unknown_fields=kind.keeps_unknown_fields,
        pd=True,
        version=kind.version,
        default=default,
        description=kind.description,
    )
