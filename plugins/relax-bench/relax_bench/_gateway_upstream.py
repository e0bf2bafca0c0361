"""The null engine behind ``relax bench gateway``: answers at once, and speaks enough of SGLang.

Run as its own process (``python -m relax_bench._gateway_upstream``); it prints one JSON
line ``{"port": P}`` when it accepts connections and serves until its stdin closes.

Besides ``POST /generate`` (a fixed ~300-byte answer) it answers what sglang-router probes when
it registers a worker (``/health``, ``/health_generate``, ``/server_info``, ``/get_server_info``,
``/model_info``, ``/get_model_info``, ``/v1/models``, ``/version``, ``/loads``, ``/metrics``),
and a ``/generate`` body with ``"stream": true`` gets ``STREAM_CHUNKS`` server-sent events,
each written separately (chunked transfer encoding), then ``data: [DONE]``.

A bare :class:`asyncio.Protocol` (on uvloop when installed) so that the upstream costs far less
per request than what is measured in front of it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

# The same ~300-byte /generate answer as the client bench's null engine.
from relax_bench._null_upstream import ANSWER, take_request

__all__ = ["STREAM_CHUNKS", "main"]

#: Events in a streamed answer.
STREAM_CHUNKS = 10_000


_INFO: dict[bytes, bytes] = {
    b"/health": b"{}",
    b"/health_generate": b"{}",
    b"/server_info": json.dumps(
        {"model_path": "null-model", "tp_size": 1, "dp_size": 1, "version": "0.0.0"}
    ).encode(),
    b"/model_info": json.dumps(
        {"model_path": "null-model", "is_generation": True, "weight_version": "default"}
    ).encode(),
    b"/v1/models": json.dumps(
        {"object": "list", "data": [{"id": "null-model", "object": "model"}]}
    ).encode(),
    b"/version": b'{"version":"0.0.0"}',
    b"/loads": b'{"loads":[]}',
    b"/metrics": b"",
}
_INFO[b"/get_server_info"] = _INFO[b"/server_info"]
_INFO[b"/get_model_info"] = _INFO[b"/model_info"]


def _response(
    body: bytes, content_type: bytes = b"application/json", status: bytes = b"200 OK"
) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


_GENERATE = _response(ANSWER)
_NOT_FOUND = _response(b'{"error":"not found"}', status=b"404 Not Found")
_EVENT = b"data: " + ANSWER + b"\n\n"
_CHUNK = f"{len(_EVENT):x}\r\n".encode() + _EVENT + b"\r\n"
_DONE = b"data: [DONE]\n\n"
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_STREAM_TAIL = f"{len(_DONE):x}\r\n".encode() + _DONE + b"\r\n0\r\n\r\n"


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._buf = bytearray()
        self._transport: Any = None
        self._streaming: asyncio.Task[None] | None = None
        self._paused: asyncio.Future[None] | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._streaming is not None:
            self._streaming.cancel()
        self.resume_writing()

    def pause_writing(self) -> None:
        self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        self._paused = None

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        while self._streaming is None:
            request = take_request(buf)
            if request is None:
                break
            head, body = request
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if method == b"POST" and path in (b"/generate", b"/v1/chat/completions"):
                if b'"stream":true' in body.replace(b" ", b""):
                    if out:
                        self._transport.write(b"".join(out))
                        out = []
                    self._streaming = asyncio.ensure_future(self._stream())
                else:
                    out.append(_GENERATE)
            elif path in _INFO:
                out.append(_response(_INFO[path]))
            else:
                out.append(_NOT_FOUND)
        if out:
            self._transport.write(b"".join(out))

    async def _stream(self) -> None:
        transport = self._transport
        transport.write(_STREAM_HEAD)
        for _ in range(STREAM_CHUNKS):
            if transport.is_closing():
                return
            if self._paused is not None:
                await self._paused
            transport.write(_CHUNK)
            await asyncio.sleep(0)  # one event per write, as an engine emits them
        transport.write(_STREAM_TAIL)
        self._streaming = None
        if self._buf:
            self.data_received(b"")


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Protocol, "127.0.0.1", 0, backlog=1024)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    await loop.run_in_executor(None, sys.stdin.buffer.read)
    server.close()


def main() -> None:
    """Serve until stdin closes."""
    try:
        import uvloop

        uvloop.run(_serve())
    except ImportError:
        asyncio.run(_serve())


if __name__ == "__main__":
    main()
