"""The lean HTTP/1.1 client under the transport, against real TCP servers on loopback.

Each server here is a real socket server on a thread that speaks (or deliberately breaks)
HTTP/1.1 byte for byte, so framing, keep-alive and failure cases are produced for real.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from relax_core._http.http1 import Http1Client
from relax_core._http.transport import Transport
from relax_core._http.upstream import PreparedRequest
from relax_core.errors import RequestNotReplayedError
from relax_core.testing import wait_for

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class RawServer:
    """Accepts connections; ``handle(conn, server)`` serves each one on its own thread."""

    def __init__(self, handle: Callable[[socket.socket, RawServer], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.handle = handle
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.open += 1
                self.most_open = max(self.most_open, self.open)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(10)
                self.handle(conn, self)
        except OSError:
            pass
        finally:
            with self.lock:
                self.open -= 1

    def read_request(self, conn: socket.socket) -> bytes:
        """One whole request (head and Content-Length body), or b"" when the peer closed."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += conn.recv(65536)
        with self.lock:
            self.requests += 1
        return head

    def close(self) -> None:
        self.release.set()
        self.sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket, RawServer], None]], RawServer]]:
    servers: list[RawServer] = []

    def start(handle: Callable[[socket.socket, RawServer], None]) -> RawServer:
        server = RawServer(handle)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def keep_alive(conn: socket.socket, server: RawServer) -> None:
    while server.read_request(conn):
        conn.sendall(OK)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def prepared(url: str, body: bytes = b"{}", headers: dict[str, str] | None = None) -> Any:
    return PreparedRequest(url + "/generate", body, headers or {}, "rid-1")


def test_a_keep_alive_connection_is_reused_for_the_next_request(serve: Any) -> None:
    server = serve(keep_alive)

    async def scenario() -> None:
        client = Http1Client()
        for _ in range(5):
            resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
            assert (resp.status, await resp.read()) == (200, b"{}")
            resp.release()
        await client.aclose()

    run(scenario())
    assert (server.requests, server.connections) == (5, 1)


def test_an_answer_with_connection_close_is_not_reused(serve: Any) -> None:
    def close_after_one(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))

    server = serve(close_after_one)

    async def scenario() -> None:
        client = Http1Client()
        for _ in range(3):
            resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
            assert await resp.read() == b"{}"
            resp.release()
        await client.aclose()

    run(scenario())
    assert server.connections == 3


def test_a_connection_idle_past_the_keepalive_limit_is_not_reused(serve: Any) -> None:
    server = serve(keep_alive)

    async def scenario() -> None:
        client = Http1Client(keepalive_timeout=0.05)
        for _ in range(2):
            resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
            await resp.read()
            resp.release()
            await asyncio.sleep(0.1)  # the idle time is what is tested
        await client.aclose()

    run(scenario())
    assert server.connections == 2


def test_idle_connections_are_closed_after_the_keepalive_limit_without_another_request(
    serve: Any,
) -> None:
    closed = threading.Event()

    def keep_alive_then_report(conn: socket.socket, server: RawServer) -> None:
        keep_alive(conn, server)
        closed.set()  # the client closed its end: read_request saw EOF

    server = serve(keep_alive_then_report)

    async def scenario() -> None:
        client = Http1Client(keepalive_timeout=0.1)
        resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
        await resp.read()
        resp.release()
        # No further request: the sweep alone closes the idle connection (its descriptor).
        await asyncio.to_thread(closed.wait, 10)
        assert closed.is_set()
        await client.aclose()

    run(scenario())


def test_a_body_without_length_ends_with_the_connection(serve: Any) -> None:
    def http10(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")

    server = serve(http10)

    async def scenario() -> bytes:
        client = Http1Client()
        resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
        body = await resp.read()
        resp.release()
        await client.aclose()
        return bytes(body)

    assert run(scenario()) == b"until the end"


def test_an_informational_answer_is_skipped(serve: Any) -> None:
    def with_continue(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(b"HTTP/1.1 100 Continue\r\nX-Early: 1\r\n\r\n" + OK)

    server = serve(with_continue)

    async def scenario() -> None:
        client = Http1Client()
        resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
        assert resp.status == 200 and "X-Early" not in resp.headers
        assert resp.headers["content-type"] == "application/json"
        assert await resp.read() == b"{}"
        resp.release()
        await client.aclose()

    run(scenario())


def test_a_chunked_body_is_handed_over_as_it_arrives(serve: Any) -> None:
    def two_chunks(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n"
        )
        server.release.wait(10)  # the second chunk only once the client has the first
        conn.sendall(b"7\r\ndata: 2\r\n0\r\n\r\n")
        server.read_request(conn)

    server = serve(two_chunks)

    async def scenario() -> list[bytes]:
        client = Http1Client()
        resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
        pieces = [await resp.content.readany()]
        server.release.set()
        pieces.append(await resp.read())
        assert resp.content.at_eof()
        resp.release()
        await client.aclose()
        return pieces

    assert run(scenario()) == [b"data: 1", b"data: 2"]


def test_an_answer_that_is_not_http_fails_as_sent_and_not_replayed(serve: Any) -> None:
    def garbage(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")

    server = serve(garbage)

    async def scenario() -> None:
        transport = Transport()
        with pytest.raises(RequestNotReplayedError) as info:
            await transport.open(prepared(server.url))
        assert info.value.status == 502 and "not valid HTTP/1.1" in info.value.message
        await transport.aclose()

    run(scenario())
    assert server.requests == 1


def test_the_connection_limit_bounds_connections_in_use(serve: Any) -> None:
    def held(conn: socket.socket, server: RawServer) -> None:
        while server.read_request(conn):
            server.release.wait(10)
            conn.sendall(OK)

    server = serve(held)

    async def scenario() -> None:
        client = Http1Client(max_connections=2)

        async def one() -> bytes:
            resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=10)
            body = await resp.read()
            resp.release()
            return bytes(body)

        tasks = [asyncio.ensure_future(one()) for _ in range(6)]
        while server.requests < 2:
            await asyncio.sleep(0.01)
        server.release.set()
        assert await asyncio.gather(*tasks) == [b"{}"] * 6
        await client.aclose()

    run(scenario())
    assert server.most_open == 2 and server.requests == 6


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent(serve: Any) -> None:
    server = serve(keep_alive)

    async def scenario() -> None:
        client = Http1Client()
        with pytest.raises(ValueError, match="line break"):
            await client.request("POST", server.url, {"X-Evil": "a\r\nHost: b"}, b"", timeout=5)
        await client.aclose()

    run(scenario())
    assert server.requests == 0


def test_the_deadline_fails_the_request_and_drops_its_connection(serve: Any) -> None:
    def silent(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        server.read_request(conn)  # returns when the client closes the connection

    server = serve(silent)

    async def scenario() -> None:
        transport = Transport()
        with pytest.raises(RequestNotReplayedError) as info:
            await transport.open(prepared(server.url), timeout=0.3)
        assert info.value.status == 504 and "within 0.3s" in info.value.message
        await transport.aclose()

    run(scenario())
    wait_for(lambda: server.open == 0, timeout=5, what="the server to see the connection end")


def test_a_large_body_read_slowly_arrives_whole(serve: Any) -> None:
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB: more than the pause threshold

    def big(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        server.read_request(conn)

    server = serve(big)

    async def scenario() -> bytes:
        client = Http1Client()
        resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=30)
        got = []
        while data := await resp.content.readany():
            got.append(data)
            await asyncio.sleep(0.005)  # a slow consumer: reading pauses and resumes
        resp.release()
        await client.aclose()
        return b"".join(got)

    assert run(scenario()) == payload


def test_a_refused_connection_is_unreachable_and_nothing_was_sent() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()

    async def scenario() -> None:
        from relax_core.errors import UpstreamUnreachableError

        transport = Transport()
        with pytest.raises(UpstreamUnreachableError) as info:
            await transport.open(prepared(url))
        assert info.value.status == 502 and "nothing was sent" in info.value.message
        await transport.aclose()

    run(scenario())


def test_coalescing_holds_a_fast_body_but_never_the_first_read(serve: Any) -> None:
    events = [b"data: %d\n\n" % i for i in range(50)]
    written = threading.Event()

    def fire_hose(conn: socket.socket, server: RawServer) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.read_request(conn)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(events[0]), events[0])
        )
        server.release.wait(10)
        for event in events[1:]:  # one segment per event, as an engine writes them
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        conn.sendall(b"0\r\n\r\n")
        written.set()
        server.read_request(conn)

    server = serve(fire_hose)

    async def scenario() -> list[bytes]:
        client = Http1Client()
        resp = await client.request("POST", server.url + "/x", {}, b"{}", timeout=30)
        # A read with nothing read before is never held, however long the window.
        first = await asyncio.wait_for(resp.content.readany(coalesce=60.0), 10)
        # The next one, right after, holds the socket for its window: what the upstream
        # writes meanwhile (49 separate writes) stays in the kernel and comes as one read (the
        # window leaves the server thread seconds for writes that take microseconds).
        holding = asyncio.ensure_future(resp.content.readany(coalesce=5.0))
        await asyncio.sleep(0)
        transport = resp._conn.transport  # type: ignore[attr-defined]
        assert not transport.is_reading()
        server.release.set()
        assert await asyncio.to_thread(written.wait, 10)
        assert not transport.is_reading()
        rest = await asyncio.wait_for(holding, 15)
        assert await resp.content.readany(coalesce=5.0) == b""  # the end is not held
        resp.release()
        await client.aclose()
        return [first, rest]

    assert run(scenario()) == [events[0], b"".join(events[1:])]


# -- the keep-alive race: a reused connection closed before any byte of its answer -----------


def test_a_reused_connection_closed_as_the_request_arrives_is_sent_once_more_on_a_fresh_one() -> (
    None
):
    # The stale keep-alive case: the server closes the idle connection exactly when the next
    # request arrives, answering nothing. It never read that request, so it is sent again,
    # once, on a new connection, and the caller sees only the answer.
    from tests.support.stale_keepalive import StaleKeepAliveServer

    with StaleKeepAliveServer() as server:

        async def scenario() -> list[int]:
            transport = Transport()
            statuses = []
            for _ in range(3):
                status, _, body = await transport.exchange(prepared(server.url))
                assert body == b'{"ok":true}'
                statuses.append(status)
            await transport.aclose()
            return statuses

        assert run(scenario()) == [200, 200, 200]
        assert (server.requests_answered, server.requests_dropped) == (3, 2)
        assert server.connections == 3


def test_a_fresh_connection_closed_before_answering_is_not_sent_again(serve: Any) -> None:
    # Only a REUSED connection can lose the keep-alive race; a new one closed after the request
    # was written may have run it, so it is never replayed.
    def read_then_close(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)

    server = serve(read_then_close)

    async def scenario() -> None:
        transport = Transport()
        with pytest.raises(RequestNotReplayedError) as info:
            await transport.open(prepared(server.url))
        assert not info.value.answer_started
        await transport.aclose()

    run(scenario())
    assert (server.requests, server.connections) == (1, 1)


def test_a_reused_connection_closed_after_the_answer_started_is_not_sent_again(
    serve: Any,
) -> None:
    def half_answer_the_second(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(OK)
        server.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Le")

    server = serve(half_answer_the_second)

    async def scenario() -> None:
        transport = Transport()
        await transport.exchange(prepared(server.url))
        with pytest.raises(RequestNotReplayedError):
            await transport.exchange(prepared(server.url))
        await transport.aclose()

    run(scenario())
    assert (server.requests, server.connections) == (2, 1)


def test_a_stale_connection_whose_fresh_attempt_cannot_connect_is_not_reported_unsent(
    serve: Any,
) -> None:
    # After the retry the request may have been sent once (the first attempt's bytes went out):
    # when the fresh connection is refused, the error must not say "nothing was sent", or a
    # caller would send the request to another replica.
    def answer_then_stop_listening(conn: socket.socket, server: RawServer) -> None:
        server.read_request(conn)
        conn.sendall(OK)
        server.sock.shutdown(socket.SHUT_RDWR)  # stops listening (close alone does not, while
        server.sock.close()  # the accepting thread waits in accept())
        conn.recv(1)  # the next request's first bytes meet the close

    server = serve(answer_then_stop_listening)

    async def scenario() -> None:
        transport = Transport()
        await transport.exchange(prepared(server.url))
        with pytest.raises(RequestNotReplayedError) as info:
            await transport.exchange(prepared(server.url))
        assert "nothing was sent" not in info.value.message
        await transport.aclose()

    run(scenario())
    assert server.connections == 1
