"""A real server on loopback that loses the keep-alive race on purpose, every time.

:class:`StaleKeepAliveServer` answers the first request of every connection with a keep-alive
``200``, then closes that connection the moment the next request's first bytes arrive, without
answering a byte. That is what a client sees when it reuses an idle pooled connection exactly
as the server closes it at its keep-alive limit (uvicorn's 5 s ``timeout_keep_alive``), made
deterministic: no timing is involved, the second request on a connection always meets a close.

It is a raw asyncio server on its own thread and loop, so nothing between the client and the
socket is simulated. ``requests_answered`` counts the answered requests; ``requests_dropped``
the connections closed on a request's first bytes (that request was never read whole, so it
never ran).
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType

__all__ = ["StaleKeepAliveServer"]

_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n"
    b"Connection: keep-alive\r\n\r\n"
    b'{"ok":true}'
)


class StaleKeepAliveServer:
    """Start with ``with StaleKeepAliveServer() as server:``; ``server.url`` is its base URL."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self.url = ""
        self.connections = 0
        self.requests_answered = 0
        self.requests_dropped = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            self.requests_answered += 1  # (counted before the client can see the answer)
            writer.write(_ANSWER)
            await writer.drain()
            # The connection is idle now. The next request's first bytes meet the close.
            if await reader.read(1):
                self.requests_dropped += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()

    def __enter__(self) -> StaleKeepAliveServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
