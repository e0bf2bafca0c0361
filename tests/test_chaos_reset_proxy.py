"""The chaos session's resetting proxy (``tests/support/reset_proxy.py``): it forwards bytes,
and its reset is a real TCP RST of every open connection and of the next new one (once its
first bytes arrived), after which connections go through again."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from tests.support.reset_proxy import ResettingProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        # the proxy resets its upstream side too
        with contextlib.suppress(ConnectionResetError):
            while data := self.request.recv(4096):
                self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[ResettingProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = ResettingProxy("127.0.0.1", server.server_address[1])
    proxy.start()
    yield proxy
    proxy.close()
    server.shutdown()
    server.server_close()


def _connect(proxy: ResettingProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=10)


def _echo(conn: socket.socket, data: bytes = b"ping") -> bytes:
    conn.sendall(data)
    return conn.recv(4096)


def test_the_proxy_forwards_bytes_both_ways(proxy: ResettingProxy) -> None:
    with _connect(proxy) as conn:
        assert _echo(conn, b"hello") == b"hello"


def test_a_reset_rsts_the_open_connections_and_the_next_new_one_then_lets_them_through(
    proxy: ResettingProxy,
) -> None:
    with _connect(proxy) as open_conn:
        assert _echo(open_conn) == b"ping"
        assert proxy.reset(new=1) == 1
        with pytest.raises(ConnectionResetError):
            _echo(open_conn)  # a reset, not a clean end (which would read b"")
    # reset once its first bytes arrived: they were sent, no answer comes
    with _connect(proxy) as new_conn, pytest.raises(ConnectionResetError):
        _echo(new_conn)
    with _connect(proxy) as after:
        assert _echo(after) == b"ping"
    assert (proxy.open_reset, proxy.new_reset, proxy.accepted) == (1, 1, 3)
