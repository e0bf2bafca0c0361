"""A null HTTP upstream for benchmarks: answers every request at once with a fixed JSON body.

Run it as a separate process so that the client under test and the server never share an event
loop or a core::

    python -m relax_bench._null_upstream --ports 64

It binds ``--ports`` listening sockets on 127.0.0.1 (each a free port chosen by the kernel),
prints one JSON line ``{"ports": [...]}`` on stdout once it accepts connections, and serves
until its stdin reaches end-of-file, so it never outlives the process that started it.

The server is a bare :class:`asyncio.Protocol` speaking HTTP/1.1 with keep-alive (on uvloop when
that is installed): it parses only the request line's end and ``Content-Length``, so it costs
far less per request than any client, and a client benchmark measures the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["ANSWER", "NullUpstream", "ready_line", "serve_forever", "spawn", "take_request"]

#: The body every request gets: the shape of an SGLang ``/generate`` answer (~300 bytes).
ANSWER = json.dumps(
    {
        "text": " The answer is 42, and the reasoning is short enough to fit in one line.",
        "output_ids": [576, 4226, 374, 220, 19, 17, 11, 323, 279, 32711, 374, 2805],
        "meta_info": {
            "id": "0" * 32,
            "prompt_tokens": 17,
            "completion_tokens": 12,
            "finish_reason": {"type": "stop", "matched": 151645},
            "weight_version": "default",
        },
    },
    separators=(",", ":"),
).encode()

_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(ANSWER)).encode()
    + b"\r\n\r\n"
    + ANSWER
)


class _NullProtocol(asyncio.Protocol):
    """Answers each complete request (headers plus ``Content-Length`` body) with ``_RESPONSE``."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; both have write().
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        answers = 0
        while take_request(buf) is not None:
            answers += 1
        if answers and self._transport is not None:
            self._transport.write(_RESPONSE * answers)


async def serve_forever(ports: int) -> None:
    """Serve on ``ports`` loopback sockets; print their ports; stop when stdin closes."""
    loop = asyncio.get_running_loop()
    servers = []
    for _ in range(ports):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        servers.append(await loop.create_server(_NullProtocol, sock=sock, backlog=1024))
    bound = [s.sockets[0].getsockname()[1] for s in servers]
    print(json.dumps({"ports": bound}), flush=True)
    # Block until the parent closes our stdin (or dies): read it in a thread.
    await loop.run_in_executor(None, sys.stdin.buffer.read)
    for s in servers:
        s.close()


class NullUpstream:
    """A running null-upstream process: ``urls`` holds one base URL per listening port."""

    def __init__(self, proc: subprocess.Popen[bytes], ports: list[int]) -> None:
        self.proc = proc
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]

    def close(self, timeout: float = 10.0) -> None:
        """Close the server's stdin and wait for it to exit (kill it after ``timeout``)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout)


@contextlib.contextmanager
def spawn(ports: int = 1, *, timeout: float = 20.0) -> Iterator[NullUpstream]:
    """Start a null upstream process with ``ports`` listening sockets; stop it when done."""
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, "--ports", str(ports)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    upstream = NullUpstream(proc, [])
    try:
        line = ready_line(proc, timeout, "the null upstream")
        upstream = NullUpstream(proc, list(json.loads(line)["ports"]))
        yield upstream
    finally:
        upstream.close()


def ready_line(proc: subprocess.Popen[bytes], timeout: float, what: str) -> bytes:
    """The first stdout line of ``proc`` (its ready line), waiting at most ``timeout`` seconds.

    :raises TimeoutError: no line came within ``timeout`` (``what`` names the process).
    :raises RuntimeError: the process closed its stdout (exited) before printing one.
    """
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"{what} did not start within {timeout:.0f}s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited (code {proc.poll()}) before it started")
    return line


def take_request(buf: bytearray) -> tuple[bytes, bytes] | None:
    """Remove the first complete request from ``buf``: its head (up to the blank line) and its
    body (``Content-Length`` bytes); None, leaving ``buf`` alone, while it is incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end])
    length = 0
    at = head.lower().find(b"\r\ncontent-length:")
    if at >= 0:
        stop = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : stop if stop >= 0 else len(head)])
    total = end + 4 + length
    if len(buf) < total:
        return None
    body = bytes(buf[end + 4 : total])
    del buf[:total]
    return head, body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ports", type=int, default=1, help="listening sockets to open")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve_forever(args.ports))
    else:
        uvloop.run(serve_forever(args.ports))


if __name__ == "__main__":
    main()
