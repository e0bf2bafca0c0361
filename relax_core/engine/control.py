"""The SGLang-protocol control client: one async client for every engine backend."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

from relax_core._http.http1 import Http1Client
from relax_core._quote import quote_body
from relax_core.engine.tags import TAG_ORDER
from relax_core.errors import LifecycleError, UpstreamError

_JSON = Mapping[str, Any]


class WeightUpdate(TypedDict, total=False):
    """What every weight update takes besides its payload (SGLang's fields): ``flush_cache``
    (default ``True``), ``abort_all_requests`` (``False``), ``weight_version`` (``None``)."""

    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None


_UPDATE_DEFAULTS = {"flush_cache": True, "abort_all_requests": False, "weight_version": None}


def _update_fields(update: WeightUpdate) -> dict[str, Any]:
    """The :class:`WeightUpdate` fields of a request body, defaults filled in.
    :raises TypeError: a keyword that is not one of them."""
    known = sorted(_UPDATE_DEFAULTS)
    if unknown := sorted(set(update) - set(known)):
        raise TypeError(f"unknown weight-update options {unknown}; known: {known}")
    return {**_UPDATE_DEFAULTS, **update}


#: How long an idle control connection is kept for reuse (below the engines' 5 s keep-alive).
KEEPALIVE_SECONDS = 2.0


class ControlClient:
    """Async client for one engine head's SGLang control API (an async context manager, or
    call :meth:`close`). Safe to share between tasks of one loop.

    Errors: unreachable, or no answer in time → :class:`~relax_core.errors.UpstreamError`
    (502; 504); a probe answered non-2xx → ``UpstreamError`` (502); an operation refused
    (non-2xx, or ``success: false``) → :class:`~relax_core.errors.LifecycleError`; each names
    the URL and quotes the engine. No request is sent twice, except one that met the
    keep-alive race of a reused idle connection (kept at most :data:`KEEPALIVE_SECONDS`)."""

    #: Whether the engine's release of ``kv_cache`` flushes its cache itself and refuses
    #: (changing nothing) while requests run, so an offload sends no ``flush_cache`` first.
    release_flushes: bool = False
    #: Whether the engine's resume takes Relax's ``check_generation`` (one greedy token).
    resume_checks: bool = False

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 30.0,
        release_flushes: bool | None = None,
        resume_checks: bool | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        if release_flushes is not None:
            self.release_flushes = bool(release_flushes)
        if resume_checks is not None:
            self.resume_checks = bool(resume_checks)
        self._client: Http1Client | None = None

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the client's connections. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # -- transport -------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, body: _JSON | None = None, *, timeout: float | None = None
    ) -> tuple[int, Any, str]:
        """One HTTP call; returns (status, parsed JSON or None, raw text)."""
        url = self.base_url + path
        limit = self.timeout if timeout is None else float(timeout)
        payload = b"" if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self._client is None:
            self._client = Http1Client(keepalive_timeout=KEEPALIVE_SECONDS)
        try:
            answer = await self._client.request(method, url, headers, payload, timeout=limit)
            try:
                text = (await answer.read()).decode("utf-8", "replace")
                status = answer.status
            finally:
                answer.release()
        except TimeoutError as exc:
            raise UpstreamError(504, f"{method} {url}: no answer within {limit:.1f}s") from exc
        except OSError as exc:
            raise UpstreamError(502, f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        return status, data, text

    @staticmethod
    def _message(data: Any, text: str) -> str:
        if isinstance(data, dict):
            for key in ("message", "error", "detail", "error_msg"):
                value = data.get(key)
                if isinstance(value, dict):
                    value = value.get("message", value)
                if value:
                    return str(value)
        return quote_body(text)

    async def _probe(self, path: str, *, timeout: float | None) -> Any:
        status, data, text = await self._request("GET", path, timeout=timeout)
        if not 200 <= status < 300:
            raise UpstreamError(
                502, f"GET {self.base_url}{path} answered {status}: {self._message(data, text)}"
            )
        return data

    async def _info(self, paths: Sequence[str], *, timeout: float | None) -> dict[str, Any]:
        last = ""
        for path in paths:
            status, data, text = await self._request("GET", path, timeout=timeout)
            if 200 <= status < 300 and isinstance(data, dict):
                return data
            last = f"GET {self.base_url}{path} answered {status}: {self._message(data, text)}"
            if status != 404:
                break
        raise UpstreamError(502, last)

    async def operate(
        self, operation: str, body: _JSON | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /{operation}``: an SGLang control operation whose path is its name; returns
        the engine's JSON answer.
        :raises LifecycleError: refused (non-2xx, or ``success: false``), quoting the engine.
        :raises UpstreamError: unreachable (502) or no answer in time (504)."""
        url = f"{self.base_url}/{operation}"
        status, data, text = await self._request("POST", f"/{operation}", body, timeout=timeout)
        if not 200 <= status < 300:
            message = self._message(data, text)
            raise LifecycleError(f"{operation} refused by {url} ({status}): {message}")
        if isinstance(data, dict):
            if data.get("success") is False:
                raise LifecycleError(f"{operation} failed at {url}: {self._message(data, text)}")
            return data
        return {"success": True, "message": text}

    # -- probes and info ---------------------------------------------------------------------

    async def health(self, *, timeout: float | None = None) -> None:
        """``GET /health``. :raises UpstreamError: unreachable, no answer in time, or non-2xx."""
        await self._probe("/health", timeout=timeout)

    async def is_healthy(self, *, timeout: float | None = None) -> bool:
        """``True`` when ``GET /health`` answers 2xx; never raises for a down server."""
        try:
            await self.health(timeout=timeout)
        except UpstreamError:
            return False
        return True

    async def health_generate(self, *, timeout: float | None = None) -> None:
        """``GET /health_generate`` (one real token). :raises UpstreamError: as :meth:`health`."""
        await self._probe("/health_generate", timeout=timeout)

    async def server_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``GET /server_info`` (falls back to ``/get_server_info`` on 404)."""
        return await self._info(("/server_info", "/get_server_info"), timeout=timeout)

    async def model_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``GET /model_info`` (``/get_model_info`` on 404); it holds ``weight_version``."""
        return await self._info(("/model_info", "/get_model_info"), timeout=timeout)

    async def weight_version(self, *, timeout: float | None = None) -> str | None:
        """The engine's current ``weight_version`` (from :meth:`model_info`)."""
        version = (await self.model_info(timeout=timeout)).get("weight_version")
        return None if version is None else str(version)

    # -- memory and scheduling ---------------------------------------------------------------

    @staticmethod
    def _tags(tags: Iterable[str] | None) -> list[str] | None:
        if tags is None:
            return None
        out = [str(t) for t in tags]
        # The engine's own names (``None`` in a call means all of them).
        if unknown := sorted(set(out) - set(TAG_ORDER)):
            raise ValueError(f"tags: unknown memory tags {unknown}; known: {list(TAG_ORDER)}")
        return out

    async def release_memory(
        self, tags: Iterable[str] | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /release_memory_occupation``: free ``tags`` (``None`` = all). Idempotent.
        :raises LifecycleError: refused. :raises ValueError: an unknown tag (before any I/O)."""
        body = {"tags": self._tags(tags)}
        return await self.operate("release_memory_occupation", body, timeout=timeout)

    async def resume_memory(
        self,
        tags: Iterable[str] | None = None,
        *,
        timeout: float | None = None,
        check_generation: bool = False,
    ) -> dict[str, Any]:
        """``POST /resume_memory_occupation``: bring ``tags`` (``None`` = all) back;
        ``check_generation`` (:attr:`resume_checks` engines): then generate one token."""
        body: dict[str, Any] = {"tags": self._tags(tags)}
        if check_generation:
            body["check_generation"] = True
        return await self.operate("resume_memory_occupation", body, timeout=timeout)

    async def pause_generation(
        self, mode: str = "abort", *, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /pause_generation``; ``mode`` is SGLang's: ``abort`` (default) or ``in_place``."""
        return await self.operate("pause_generation", {"mode": mode}, timeout=timeout)

    async def continue_generation(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``POST /continue_generation``: undo :meth:`pause_generation`."""
        return await self.operate("continue_generation", {}, timeout=timeout)

    async def flush_cache(
        self, *, wait: float = 0.0, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /flush_cache``, retried for up to ``wait`` seconds while refused (requests
        pending). :raises LifecycleError: still refused then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        delay = 0.02
        while True:
            try:
                return await self.operate("flush_cache", None, timeout=timeout)
            except LifecycleError:
                if loop.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def abort(
        self, rid: str | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /abort_request``: abort request ``rid``, or every request when ``rid`` is None."""
        body: dict[str, Any] = {"rid": rid} if rid is not None else {"rid": "", "abort_all": True}
        return await self.operate("abort_request", body, timeout=timeout)

    # -- weights -----------------------------------------------------------------------------

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        timeout: float | None = None,
        **update: Unpack[WeightUpdate],
    ) -> dict[str, Any]:
        """``POST /update_weights_from_tensor`` (one serialized payload per TP rank);
        ``update``: see :class:`WeightUpdate`."""
        body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            **_update_fields(update),
        }
        return await self.operate("update_weights_from_tensor", body, timeout=timeout)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        timeout: float | None = None,
        **update: Unpack[WeightUpdate],
    ) -> dict[str, Any]:
        """``POST /update_weights_from_disk``: load a checkpoint directory (same architecture);
        ``update``: see :class:`WeightUpdate`."""
        body = {"model_path": model_path, "load_format": load_format, **_update_fields(update)}
        return await self.operate("update_weights_from_disk", body, timeout=timeout)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """``POST /init_weights_update_group``: join the trainer's (rank 0's) broadcast group,
        concurrently with it; the engine's ranks start at ``rank_offset``."""
        body = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        return await self.operate("init_weights_update_group", body, timeout=timeout)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        timeout: float | None = None,
        **update: Unpack[WeightUpdate],
    ) -> dict[str, Any]:
        """``POST /update_weights_from_distributed``: receive tensors broadcast by rank 0, in
        order, while this call is in flight; ``update``: see :class:`WeightUpdate`."""
        body = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            **({"load_format": load_format} if load_format is not None else {}),
            **_update_fields(update),
        }
        return await self.operate("update_weights_from_distributed", body, timeout=timeout)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout: float | None = None
    ) -> dict[str, Any]:
        """``POST /destroy_weights_update_group``: leave the broadcast group."""
        body = {"group_name": group_name}
        return await self.operate("destroy_weights_update_group", body, timeout=timeout)

    def __repr__(self) -> str:
        return f"ControlClient({self.base_url!r}, timeout={self.timeout})"
