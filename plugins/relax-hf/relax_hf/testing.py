"""Test helpers for the hf engine: a blocking JSON client and engine servers on loopback.

Used by this plugin's tests and by integration tests that need real hf engines.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from relax_core import (
    EngineLaunchSpec,
    EngineOptions,
    LifecycleError,
    SubprocessEngineProcess,
    free_port,
)
from relax_hf.plugin import launch

if TYPE_CHECKING:
    import torch

__all__ = [
    "START_TIMEOUT",
    "EngineServer",
    "Http",
    "ReplicaServers",
    "start_engine",
    "start_replica",
]

START_TIMEOUT = 120.0


class Http:
    """A small blocking JSON client (each call has a timeout)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, Any, dict[str, str]]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                text = resp.read().decode()
                status, headers = resp.status, dict(resp.headers)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode()
            status, headers = exc.code, dict(exc.headers)
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = text
        return status, parsed, headers

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        status, body, _ = self.request("GET", path, **kw)
        return status, body

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, body, _ = self.request("POST", path, body, **kw)
        return status, body

    def ok(self, path: str, body: Any = None, **kw: Any) -> Any:
        """POST (GET without a body) and assert 200; return the JSON answer."""
        method = (
            "GET"
            if body is None and path in ("/server_info", "/model_info", "/v1/models")
            else "POST"
        )
        status, out, _ = self.request(method, path, body, **kw)
        assert status == 200, f"{method} {path} -> {status}: {out}"
        return out

    def generate(self, text: str = "Hello", **kw: Any) -> dict[str, Any]:
        body = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        body.update(kw)
        return self.ok("/generate", body)  # type: ignore[no-any-return]

    def stream(self, path: str, body: Any, *, timeout: float = 60.0) -> list[bytes]:
        """POST and return the raw SSE events (each ending in a blank line)."""
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = resp.read()
        return [chunk + b"\n\n" for chunk in raw.split(b"\n\n") if chunk]


class EngineServer:
    """A running hf engine process and an HTTP helper for it."""

    def __init__(self, process: SubprocessEngineProcess) -> None:
        self.process = process
        assert process.base_url is not None
        self.url = process.base_url
        self.http = Http(self.url)


_OPTION_FIELDS = frozenset(f.name for f in attrs.fields(EngineOptions))


def _spec(env: dict[str, str], **fields: Any) -> EngineLaunchSpec:
    """An ``EngineLaunchSpec`` of ``fields``: those naming an :class:`EngineOptions` field
    (``extra_args``, ``dtype``, ``weights_cpu_backup``, …) go into its ``options``, with
    ``env`` under the caller's own."""
    options = {k: fields.pop(k) for k in list(fields) if k in _OPTION_FIELDS}
    options["env"] = {**env, **options.get("env", {})}
    return EngineLaunchSpec(**fields, options=EngineOptions(**options))


def start_engine(
    model: Path | str, log_dir: Path | str, engine_id: str, **spec: Any
) -> EngineServer:
    """Launch an hf engine through the backend and wait until it answers ``/health``.

    ``spec``: ``EngineLaunchSpec`` fields, and ``EngineOptions`` fields for its ``options``.
    """
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    process = launch(
        _spec(
            env,
            engine_id=engine_id,
            model_path=str(model),
            log_path=str(Path(log_dir) / f"{engine_id}.log"),
            **spec,
        )
    )
    try:
        process.wait_ready(START_TIMEOUT)
    except BaseException:
        process.terminate(5)
        raise
    return EngineServer(process)


def gathered_decode_attention(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The ``torch_native`` decode step's attention, with the engine's own functions, in
    float32: what the decode kernel's tests (``--attention-backend triton``) compare with.
    ``q [rows, heads, d]``, one layer's ``cache [slots, 2, kv_heads, d]``, the rows'
    ``table [rows, bucket]`` and ``positions [rows]``, as
    :func:`relax_hf.paged_attention.decode_attention` takes them."""
    import torch

    from relax_hf.modeling import _decode_mask, gathered_attention

    mask = _decode_mask(table, positions, torch.float32)
    scale = q.shape[-1] ** -0.5
    return gathered_attention(q.float(), cache.float(), table.reshape(-1), mask, scale)


class ReplicaServers:
    """A running multi-node hf replica on one machine: the head's server and its followers."""

    def __init__(
        self, head: SubprocessEngineProcess, followers: list[SubprocessEngineProcess]
    ) -> None:
        self.head = EngineServer(head)
        self.followers = followers
        self.http = self.head.http

    @property
    def processes(self) -> list[SubprocessEngineProcess]:
        """The head's process first, then each follower's."""
        return [self.head.process, *self.followers]

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop every node (idempotent)."""
        for process in self.processes:
            process.terminate(timeout)


def start_replica(
    model: Path | str,
    log_dir: Path | str,
    engine_id: str,
    *,
    nnodes: int = 2,
    follower_model: Path | str | None = None,
    wait: bool = True,
    **spec: Any,
) -> ReplicaServers:
    """Launch a head and ``nnodes - 1`` followers on loopback; wait until all are ready.

    ``follower_model`` loads another checkpoint on the followers (to test the head's check).
    With ``wait`` false it returns at once (the caller waits, or watches them fail).
    """
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    addr = f"127.0.0.1:{free_port()}"

    def node(rank: int, path: Path | str) -> SubprocessEngineProcess:
        name = engine_id if rank == 0 else f"{engine_id}-node-{rank}"
        return launch(
            _spec(
                env,
                engine_id=name,
                model_path=str(path),
                nnodes=nnodes,
                node_rank=rank,
                dist_init_addr=addr,
                log_path=str(Path(log_dir) / f"{name}.log"),
                **spec,
            )
        )

    processes = [node(0, model)]
    try:
        processes += [node(r, follower_model or model) for r in range(1, nnodes)]
        replica = ReplicaServers(processes[0], processes[1:])
        if wait:
            _wait_all(processes, START_TIMEOUT)
    except BaseException:
        for process in processes:
            process.terminate(5)
        raise
    return replica


def _wait_all(processes: list[SubprocessEngineProcess], timeout: float) -> None:
    """Until every node of a replica is ready, polling all of them: the first that exits, or
    the deadline, raises — with the other nodes' log tails noted (a follower waiting on a head
    that is stuck or gone says so)."""
    deadline = time.monotonic() + timeout
    pending = list(processes)
    while pending:
        for process in list(pending):
            try:
                process.wait_ready(min(0.5, max(0.05, deadline - time.monotonic())))
            except LifecycleError as exc:
                error = exc
                if process.poll() is None:
                    if time.monotonic() < deadline:
                        continue
                    error = LifecycleError(
                        f"engine {process.engine_id}: not ready within {timeout:.1f}s (process "
                        f"{process.pid} still running); {exc}"
                    )
                for other in processes:
                    if other is not process:
                        state = "running" if other.poll() is None else f"exit {other.poll()}"
                        tail = "\n    ".join(other.log_tail(4000).splitlines()[-15:])
                        error.add_note(
                            f"engine {other.engine_id} ({state}), log {other.log_path}:\n    {tail}"
                        )
                raise error from None
            pending.remove(process)
