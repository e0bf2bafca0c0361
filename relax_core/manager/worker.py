"""The engine worker: an async Ray actor per node of a logical replica, owning one engine
process; the head (node rank 0) also owns the admission server and the control channel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import attrs

from relax_core.engine._logtail import quote_log
from relax_core.engine.admission import AdmissionServer
from relax_core.engine.process import safe_file_name
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.engine.tags import ResidentTag, ordered
from relax_core.errors import CapabilityError, LifecycleError, RelaxError, UpstreamError
from relax_core.manager.channel import ControlAddress, ControlChannelServer
from relax_core.manager.reaper import start_reaper
from relax_core.net import free_port
from relax_core.records import EngineBackend, EngineLaunchSpec, EngineProcess

#: Control-client methods a weight update may call, with the update path each belongs to.
UPDATE_METHODS: dict[str, str] = {
    "update_weights_from_tensor": "tensor",
    "update_weights_from_disk": "disk",
    "update_weights_from_distributed": "distributed",
    "init_weights_update_group": "distributed",
    "destroy_weights_update_group": "distributed",
    "load_lora_adapter": "lora",
    "unload_lora_adapter": "lora",
}
#: Update calls the control client has no method for: sent as they are (``POST /{name}``).
_RAW_UPDATES = frozenset({"load_lora_adapter", "unload_lora_adapter"})
log = logging.getLogger(__name__)


@attrs.frozen
class StartResult:
    """What a started worker reports: engine pid, public (admission) URL, node, version."""

    engine_id: str
    node_rank: int
    pid: int
    public_url: str | None
    node_ip: str
    node_id: str | None = None
    weight_version: str | None = None
    #: the head's private control endpoint (onload/offload over HTTP); never published
    control: ControlAddress | None = None


@attrs.frozen
class ProbeResult:
    """One worker's health: its process, and for a head, one real generation."""

    engine_id: str
    node_rank: int
    pid: int | None
    alive: bool
    exit_code: int | None
    generate_ok: bool | None
    error: str | None = None

    @property
    def healthy(self) -> bool:
        """Process alive, and (for a head asked to generate) the generation succeeded."""
        return self.alive and self.generate_ok is not False


class EngineWorker:
    """One node of a logical replica (create it with ``ray.remote(EngineWorker).options(...)``).

    :param engine_id: the replica's engine id (``model/replica-0``).
    :param node_rank: 0 for the head, 1.. for followers.
    :param spec: the model's :class:`InferenceEngineSpec`; checked again here, at the engine.
    :param public_host: the host the admission server binds and publishes (head only)."""

    def __init__(
        self,
        *,
        engine_id: str,
        node_rank: int,
        backend: EngineBackend,
        spec: InferenceEngineSpec,
        public_host: str | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.node_rank = node_rank
        self.backend = backend
        self.spec = spec
        self.node_ip = _node_ip()
        self.public_host = public_host or self.node_ip
        self.process: EngineProcess | None = None
        self.admission: AdmissionServer | None = None
        self.channel: ControlChannelServer | None = None
        self.control: Any = None
        self.reaper_pid: int | None = None
        self._lock = asyncio.Lock()

    @property
    def _name(self) -> str:
        return f"{self.engine_id} node {self.node_rank}"

    # -- start -----------------------------------------------------------------------------

    async def rendezvous_address(self) -> str:
        """``ip:port`` on this node where the head's distributed group will listen."""
        return f"{self.node_ip}:{free_port(self.node_ip)}"

    async def actor_pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    async def start(self, launch: EngineLaunchSpec, ready_timeout: float) -> StartResult:
        """Launch the engine process, wait until it is ready; a head also starts its admission
        (closed) and its control channel.
        :raises LifecycleError: the process could not start or was not ready in time (it is
            stopped again first); one that exited is quoted from its log."""
        async with self._lock:
            if self.process is not None:
                raise LifecycleError(f"{self._name}: already started (pid {self.process.pid})")
            if launch.node_rank == 0 and launch.port == 0:
                launch = attrs.evolve(launch, port=free_port(launch.host))
            if launch.log_path is None:
                launch = attrs.evolve(launch, log_path=_log_path(launch.engine_id))
            self.process = await asyncio.to_thread(self.backend.launch, launch)
            self.reaper_pid = await asyncio.to_thread(start_reaper, os.getpid(), self.process.pid)
            try:
                await asyncio.to_thread(self.process.wait_ready, ready_timeout)
                version = None
                if launch.node_rank == 0:
                    engine_url = self.process.base_url or f"http://{launch.host}:{launch.port}"
                    self.control = self.backend.control_client(engine_url)
                    version = await self.control.weight_version(timeout=ready_timeout)
                    self.admission = AdmissionServer(
                        engine_url, engine_id=self.engine_id, spec=self.spec, host=self.public_host
                    )
                    await self.admission.start()
                    self.channel = ControlChannelServer(
                        {
                            "offload": self.offload,
                            "onload": self.onload,
                            "admission_state": self.admission_state,
                        },
                        engine_id=self.engine_id,
                        host=self.public_host,
                    )
                    await self.channel.start()
            except BaseException as exc:
                exited = self.process.poll()
                if self.channel is not None:
                    await self.channel.stop()
                await self._stop_process(timeout=10.0)
                log_path = launch.log_path
                quoted = bool(log_path) and str(log_path) in str(exc)
                if exited is not None and isinstance(exc, Exception) and not quoted:
                    # The backend's error does not say why its process died: its log does.
                    raise LifecycleError(
                        f"{self._name}: engine process {self.process.pid} exited with code "
                        f"{exited} during its start ({type(exc).__name__}: {exc}); "
                        f"{quote_log(log_path)}"
                    ) from exc
                raise
            return StartResult(
                engine_id=self.engine_id,
                node_rank=self.node_rank,
                pid=self.process.pid,
                public_url=self.admission.base_url if self.admission else None,
                node_ip=self.node_ip,
                node_id=_node_id(),
                weight_version=version,
                control=self.channel.address if self.channel else None,
            )

    # -- health ----------------------------------------------------------------------------

    async def probe(self, *, generate: bool, timeout: float) -> ProbeResult:
        """Is the engine process alive; for a head with ``generate``, does it generate a token."""
        process = self.process
        if process is None:
            return ProbeResult(
                self.engine_id, self.node_rank, None, False, None, None, "not started"
            )
        error = None
        control = self.control if generate and process.poll() is None else None
        if control is not None and self._lock.locked():
            # A lifecycle call holds the engine and confirms it itself: a generation would race
            # it (a release is refused while a request runs).
            control = None
        if control is not None:
            async with self._lock:
                try:
                    await control.health_generate(timeout=timeout)
                except RelaxError as exc:
                    error = str(exc)
        # A killed engine's port closes before its exit is reaped: give it a moment, so a death
        # counts as a death, not as one of the failed probes a live engine is allowed.
        code = process.poll()
        if code is None and error is not None:
            code = await _exit_code_within(process, _EXIT_GRACE_S)
        if code is not None:
            return ProbeResult(
                self.engine_id, self.node_rank, process.pid, False, code, None,
                f"engine process {process.pid} exited with code {code}",
            )  # fmt: skip
        ok = error is None if control is not None else None
        return ProbeResult(self.engine_id, self.node_rank, process.pid, True, None, ok, error)

    async def engine_pid(self) -> int | None:
        """The engine process id (``None`` before start)."""
        return self.process.pid if self.process else None

    async def admission_state(self) -> dict[str, Any]:
        """``{"open": bool, "inflight": int}`` of the head's admission server."""
        if self.admission is None:
            return {"open": False, "inflight": 0}
        return {"open": self.admission.is_open, "inflight": self.admission.inflight}

    # -- lifecycle (head only) -------------------------------------------------------------

    def _head(self) -> tuple[Any, AdmissionServer]:
        if self.control is None or self.admission is None:
            raise LifecycleError(f"{self._name}: not a started head; lifecycle calls go to node 0")
        return self.control, self.admission

    async def _drain(self, *, strict: bool, drain_timeout: float, timeout: float) -> None:
        control, admission = self._head()
        admission.close("DRAINING")
        if not (strict and await admission.wait_idle(drain_timeout)):
            # Not strict, or the deadline passed: abort what is still running.
            await control.abort(timeout=timeout)
            await self._drained(admission, "abort", timeout)

    async def _drained(self, admission: AdmissionServer, after: str, timeout: float) -> None:
        if not await admission.wait_idle(min(timeout, 10.0)):
            raise LifecycleError(
                f"{self._name}: {admission.inflight} request(s) still in flight after {after}; "
                "the engine did not drain"
            )

    async def offload(
        self,
        tags: Sequence[str],
        *,
        strict: bool,
        drain_timeout: float,
        timeout: float,
        abort: bool = False,
    ) -> dict[str, float]:
        """Close admission, drain, flush and release ``tags``; return the seconds it took
        (``seconds``), of them the drain's (``drain``) and the release's calls to the engine
        (``engine_calls``). ``abort``: abort the requests in flight (paused, then continued)
        instead of draining.
        :raises LifecycleError: a step was refused or did not finish within ``timeout``; the
            memory is then *not* known to be free."""
        self.spec.check("offload", engine_id=self.engine_id)
        start = time.monotonic()
        async with self._lock, asyncio.timeout(drain_timeout + timeout):
            control, admission = self._head()
            began = time.monotonic()
            if not abort:
                await self._drain(strict=strict, drain_timeout=drain_timeout, timeout=timeout)
                drained = time.monotonic()
                await self._release(tags, timeout=timeout)
                released = time.monotonic()
            else:
                try:
                    # Nothing runs until continued.
                    admission.close("DRAINING")
                    await control.pause_generation("abort", timeout=timeout)
                    await self._drained(admission, "pause_generation (abort)", timeout)
                    drained = time.monotonic()
                    await self._release(tags, timeout=timeout)
                except BaseException as exc:
                    # Whatever failed: a paused engine would never generate again.
                    try:
                        await control.continue_generation(timeout=min(timeout, 5.0))
                    except Exception as second:
                        exc.add_note(f"continue_generation failed too: {second}")
                    raise
                released = time.monotonic()
                await control.continue_generation(timeout=timeout)
        spent = {"drain": drained - began, "engine_calls": released - drained}
        return {"seconds": time.monotonic() - start, **spent}

    async def _release(self, tags: Sequence[str], *, timeout: float) -> None:
        control, _ = self._head()
        if ResidentTag.KV_CACHE in tags:
            if getattr(control, "release_flushes", False):
                # One round trip, unless refused (changing nothing) while a request runs.
                with contextlib.suppress(LifecycleError):
                    await control.release_memory(ordered(tags), timeout=timeout)
                    return
            await control.flush_cache(wait=timeout, timeout=timeout)
        await control.release_memory(ordered(tags), timeout=timeout)

    async def onload(
        self, tags: Sequence[str], *, reopen: bool, timeout: float
    ) -> dict[str, float]:
        """Resume ``tags`` (weights first); with ``reopen``, check one generation, then open.
        Return the seconds it took (``seconds``), of them its calls to the engine
        (``engine_calls``).
        :raises LifecycleError: a resume was refused or the check failed; admission stays closed."""
        self.spec.check("onload", engine_id=self.engine_id)
        start = time.monotonic()
        async with self._lock, asyncio.timeout(2 * timeout):
            control, admission = self._head()
            called = time.monotonic()
            check = reopen and getattr(control, "resume_checks", False)
            if check:
                answer = await control.resume_memory(
                    ordered(tags), timeout=timeout, check_generation=True
                )
                check = bool(answer.get("generation_checked"))
            else:
                await control.resume_memory(ordered(tags), timeout=timeout)
            if reopen and not check:
                await control.health_generate(timeout=timeout)
            engine = time.monotonic() - called
            if reopen:
                admission.open()
        return {"seconds": time.monotonic() - start, "engine_calls": engine}

    async def drain(self, *, strict: bool, drain_timeout: float, timeout: float) -> None:
        """Close admission and drain in-flight requests (before a scale-in shutdown)."""
        live = self.process is not None and self.process.poll() is None
        if live and self.control is not None and self.admission is not None:
            async with self._lock:
                await self._drain(strict=strict, drain_timeout=drain_timeout, timeout=timeout)

    async def open_admission(self, *, check: bool, timeout: float) -> None:
        """Open admission (after a generation check when ``check``)."""
        control, admission = self._head()
        if check:
            await control.health_generate(timeout=timeout)
        admission.open()

    async def close_admission(self, reason: str = "DRAINING") -> None:
        """Close admission (503 + Retry-After to new generation requests)."""
        if self.admission is not None:
            self.admission.close(reason)

    async def update_weights(
        self,
        method: str,
        kwargs: dict[str, Any],
        *,
        fence: bool,
        reopen: bool,
        drain_timeout: float,
        timeout: float,
        pause: str | None = None,
        buckets: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """Apply one weight update to the engine: with ``fence``, admission closed and drained
        first; with ``reopen``, one generation checked and admission reopened after; with
        ``pause``, generation paused in that mode around it instead.

        ``buckets``: one engine call per bucket (``kwargs`` with the bucket's own over them),
        in order; every call but the last keeps the engine's version (and its cache).
        :raises CapabilityError: the engine's spec does not allow the update path.
        :raises LifecycleError: the engine refused or failed the update (admission stays
            closed); for buckets, which one failed and how many had landed before it."""
        operation = UPDATE_METHODS.get(method)
        if operation is None:
            raise CapabilityError(
                f"{self._name}: {method!r} is not a weight-update call; "
                f"known: {sorted(UPDATE_METHODS)}"
            )
        self.spec.check(operation, engine_id=self.engine_id)
        async with self._lock:
            control, admission = self._head()
            if fence:
                admission.close("UPDATING")
                await self._drain(strict=True, drain_timeout=drain_timeout, timeout=timeout)
            if pause is not None:
                await control.pause_generation(pause, timeout=timeout)
            try:
                if buckets:
                    result = await self._update_in_buckets(
                        control, method, kwargs, buckets, timeout=timeout
                    )
                elif method in _RAW_UPDATES:
                    result = await control.operate(method, kwargs, timeout=timeout)
                else:
                    result = await getattr(control, method)(**kwargs, timeout=timeout)
            finally:
                if pause is not None:
                    await control.continue_generation(timeout=timeout)
            if reopen:
                await control.health_generate(timeout=timeout)
                admission.open()
            version = await control.weight_version(timeout=timeout)
        return {"result": result, "weight_version": version}

    async def _update_in_buckets(
        self,
        control: Any,
        method: str,
        kwargs: dict[str, Any],
        buckets: Sequence[dict[str, Any]],
        *,
        timeout: float,
    ) -> dict[str, Any]:
        """One engine call per bucket (see :meth:`update_weights`); the last call's answer
        with ``buckets`` (the count). :raises LifecycleError: which bucket failed."""
        if method in _RAW_UPDATES:
            raise CapabilityError(f"{self._name}: {method!r} cannot be sent in buckets")
        held = await control.weight_version(timeout=timeout)
        call = getattr(control, method)
        last = len(buckets) - 1
        result: dict[str, Any] = {}
        for i, bucket in enumerate(buckets):
            args = {**kwargs, **bucket}
            if i < last:
                args.update(weight_version=held, flush_cache=False)
            try:
                result = await call(**args, timeout=timeout)
            except (LifecycleError, UpstreamError) as exc:
                landed = (
                    f"buckets 1-{i} of the new weights are loaded, the rest are version {held}"
                    if i
                    else f"nothing was loaded; the weights are still version {held}"
                )
                raise LifecycleError(
                    f"{self._name}: {method} bucket {i + 1} of {len(buckets)} failed ({landed}); "
                    f"the engine still reports version {held}: {exc}"
                ) from exc
        return {**result, "buckets": len(buckets)}

    # -- shutdown --------------------------------------------------------------------------

    async def _stop_process(self, timeout: float) -> int | None:
        process = self.process
        if process is None:
            return None
        code = await asyncio.to_thread(process.terminate, timeout)
        reaper, self.reaper_pid = self.reaper_pid, None
        if reaper:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(reaper, 15)
        return code

    async def shutdown(self, timeout: float) -> dict[str, Any]:
        """Stop admission and the engine process (SIGTERM, SIGKILL after ``timeout``); return
        ``{"pid", "exit_code"}`` once it is confirmed gone. Idempotent."""
        if self.admission is not None:
            self.admission.close("STOPPING")
        if self.control is not None:
            try:
                await self.control.close()
            except (OSError, RuntimeError) as exc:
                # Closing the control client must not stop the engine's shutdown.
                log.warning("%s: closing the control client failed: %s", self._name, exc)
        if self.channel is not None:
            await self.channel.stop()
        code = await self._stop_process(timeout)
        if self.admission is not None:
            await self.admission.stop()
        return {"pid": self.process.pid if self.process else None, "exit_code": code}


#: How long a probe whose generation failed waits for the engine process to be reaped.
_EXIT_GRACE_S = 1.0


async def _exit_code_within(process: EngineProcess, seconds: float) -> int | None:
    """The process's exit code if it exits within ``seconds``, else ``None`` (it lives)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        code = process.poll()
        if code is not None:
            return code
    return None


def _log_path(engine_id: str) -> str:
    """A fresh log file for ``engine_id`` in this node's temporary directory."""
    directory = os.path.join(tempfile.gettempdir(), "relax-engines")
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(
        prefix=f"{safe_file_name(engine_id)}-", suffix=".log", dir=directory
    )
    os.close(fd)
    return path


def _node_id() -> str | None:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # outside a Ray worker: no node id
        return None


def _node_ip() -> str:
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:  # outside a Ray worker: loopback
        return "127.0.0.1"
