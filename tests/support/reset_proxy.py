"""A TCP proxy on loopback that resets connections on demand (the chaos session's ``reset``
fault).

:class:`ResettingProxy` forwards every connection it accepts to one upstream ``host:port``,
byte for byte, on an asyncio loop of its own thread. :meth:`ResettingProxy.reset` closes every
open connection with a TCP RST (``SO_LINGER`` 0, then an abort: the peer reads
``ECONNRESET``, never a clean end), on the client's side and the upstream's, and resets the next
``new`` connections it accepts the same way, once their first bytes arrived (however late
they come, unless ``hold`` seconds bound the wait): a request in flight at that moment, one
sent on a pooled connection it reset, or one sent on a new connection then, fails after it was
sent, as a real reset makes it fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import struct
import threading
import time
from typing import Any

import attrs

from relax_core.testing import free_port

__all__ = ["ResettingProxy"]


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with a RST."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@attrs.define(eq=False)
class ResettingProxy:
    """``http://127.0.0.1:<port>`` in front of ``upstream_host:upstream_port`` (see the module
    docstring). :meth:`start` before use, :meth:`close` after; :meth:`reset` from any thread.

    ``open_reset`` and ``new_reset`` count the connections reset (open ones, new ones);
    ``accepted`` every connection accepted.
    """

    upstream_host: str
    upstream_port: int
    port: int = attrs.field(factory=free_port)
    open_reset: int = 0
    new_reset: int = 0
    accepted: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: Any = None
    _pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = attrs.field(factory=set)
    _reset_new: int = 0
    _reset_until: float = 0.0

    @property
    def url(self) -> str:
        """The proxy's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Listen (on its own thread's loop); the URL."""
        loop = self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)

            async def listen() -> None:
                self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

            loop.run_until_complete(listen())
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="reset-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError(f"the proxy did not listen on port {self.port} within 30 s")
        return self.url

    def reset(self, *, new: int = 1, hold: float | None = None) -> int:
        """RST every open connection now, and the next ``new`` connections accepted (within
        ``hold`` seconds, if given); how many open connections were reset."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(self._reset(new, hold), self._loop).result(30)

    def close(self) -> None:
        """Stop listening, RST what is open, stop the loop. Idempotent."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            await self._reset(0, 0.0)
            # Every connection's task ended here: none is left for the garbage collector to
            # report (a finalizer's log in the middle of another thread's work).
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        loop.close()

    async def _reset(self, new: int, hold: float | None) -> int:
        pairs, self._pairs = self._pairs, set()
        for client, upstream in pairs:
            _rst(client)
            _rst(upstream)
        self.open_reset += len(pairs)
        self._reset_new = new
        self._reset_until = math.inf if hold is None else time.monotonic() + hold
        return len(pairs)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._reset_new > 0 and time.monotonic() < self._reset_until:
            self._reset_new -= 1
            self.new_reset += 1
            # Once the request's first bytes arrived: it was sent, then reset (a reset at
            # accept would be a connect failure, which a client may send again elsewhere).
            with contextlib.suppress(ConnectionError, OSError):
                await reader.read(65536)
            _rst(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:
            _rst(writer)
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._pairs.discard(pair)
            for w in pair:
                if not w.transport.is_closing():
                    w.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until either side ends; a clean end is passed on."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if not writer.transport.is_closing() and writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        if not writer.transport.is_closing():
            writer.transport.abort()
