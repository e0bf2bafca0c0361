"""The node group of a multi-node hf replica: a head (node rank 0) and its followers.

The hf engine does not shard a model: every node of a multi-node replica loads the same model
and runs the same computation. The head serves HTTP and schedules; each follower mirrors it,
step by step, so the replica behaves as one engine that spans nodes and fails as a whole.

How the nodes talk:

- **Rendezvous.** The head hosts a ``torch.distributed.TCPStore`` at ``dist_init_addr``; every
  node builds a gloo process group of world size ``nnodes`` on it (its own group, not the
  process's default one, which stays free for a trainer's weight-update group).
- **Commands.** One TCP connection per follower (its address is published in the store) carries
  JSON lines from the head: every step (the new sequences, the aborts it applies) and every
  lifecycle operation (release, resume, flush, weight loads and reloads, shutdown). When that
  connection closes, the other side knows at once that its peer is gone: the head marks itself
  unhealthy (a lost follower), a follower exits (a lost head).
- **Data.** After each sampling every node all-gathers the tokens it picked (so a follower's
  forward pass is part of every step, and the head counts any token a follower computed
  differently); the followers continue with the head's tokens. Weight updates are relayed from
  the head to the followers by gloo broadcasts of byte buckets.

A collective that fails (a peer died mid-step) or times out (``dist_timeout``) breaks the group
as a lost connection does. A broken group is never repaired: the replica must be restarted.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from relax_hf.protocol import parse_dist_addr
from relax_hf.runner import ModelRunner
from relax_hf.weights import parse_dtype

__all__ = [
    "FollowerNode",
    "HeadNodes",
    "NodeLost",
    "fingerprint",
    "parse_dist_addr",
]

log = logging.getLogger(__name__)

_CONTROL_KEY = "relax_hf/control"
_BUCKET_BYTES = 64 << 20


class NodeLost(RuntimeError):
    """The node group is broken: a peer is gone, a collective failed, or the nodes diverged."""


def fingerprint(runner: ModelRunner) -> dict[str, Any]:
    """What every node of a replica must agree on: model shape, dtype and a weights digest."""
    return {
        "model_type": getattr(runner.config, "model_type", None),
        "param_bytes": runner.param_bytes,
        "vocab_size": runner.vocab_size,
        "dtype": str(runner.dtype),
        "weights_sha256": runner.weights_digest(),
    }


def _keepalive(sock: socket.socket) -> None:
    # A peer whose host vanished (no FIN) is found by keepalive probes within ~25 s.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _route_ip(host: str) -> str:
    """This machine's address on the route to ``host`` (the interface gloo should use)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _send_line(sock: socket.socket, obj: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")


class _Group:
    """The gloo process group shared by the head and the followers."""

    def __init__(self, rank: int, nnodes: int, timeout_s: float) -> None:
        self.rank = rank
        self.nnodes = nnodes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.store: Any = None
        self.pg: Any = None
        self.steps = 0
        self.tokens_synced = 0

    def _make_group(self, local_ip: str) -> None:
        import torch.distributed as dist

        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        options._timeout = self.timeout
        self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.nnodes, options)

    def _all_gather_tokens(self, tokens: list[int]) -> list[list[int]]:
        mine = torch.tensor(tokens, dtype=torch.long)
        outs = [torch.empty_like(mine) for _ in range(self.nnodes)]
        self.pg.allgather([outs], [mine]).wait()
        self.steps += 1
        self.tokens_synced += len(tokens)
        return [o.tolist() for o in outs]


def _buckets(sizes: Sequence[int]) -> Iterator[list[int]]:
    """Indices of consecutive tensors grouped into buckets of at most ~64 MiB each."""
    bucket: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if bucket and total + n > _BUCKET_BYTES:
            yield bucket
            bucket, total = [], 0
        bucket.append(i)
        total += n
    if bucket:
        yield bucket


def _wire_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).cpu().view(torch.uint8)


class HeadNodes(_Group):
    """The head's side (node rank 0): hosts the rendezvous, commands the followers.

    Build it with :meth:`listen` before loading the model and call :meth:`join` after; then
    :meth:`send`, :meth:`sync_tokens` and :meth:`send_tensors` run on the engine's compute
    thread only (they are never called concurrently). :attr:`lost` says why the group is
    broken (``None`` while healthy); ``on_lost`` is called once, from any thread, when it breaks.
    """

    def __init__(self, host: str, port: int, nnodes: int, timeout_s: float) -> None:
        super().__init__(0, nnodes, timeout_s)
        self.host, self.port = host, port
        self.listener: socket.socket | None = None
        self.followers: dict[int, dict[str, Any]] = {}
        self._conns: dict[int, socket.socket] = {}
        self._readers: dict[int, Any] = {}
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.diverged_tokens = 0
        self._closing = False
        self._lock = threading.Lock()

    @classmethod
    def listen(cls, dist_init_addr: str | None, nnodes: int, timeout_s: float) -> HeadNodes:
        """Host the rendezvous store at ``dist_init_addr`` and open the command listener.

        :raises ValueError: a malformed address. :raises OSError: the port cannot be bound.
        """
        import torch.distributed as dist

        host, port = parse_dist_addr(dist_init_addr)
        head = cls(host, port, nnodes, timeout_s)
        head.store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, nnodes, True, timeout=head.timeout, wait_for_workers=False
        )
        listener = socket.create_server((host, 0), backlog=nnodes)
        head.listener = listener
        head.store.set(_CONTROL_KEY, f"{host}:{listener.getsockname()[1]}")
        return head

    def join(self, mine: Mapping[str, Any]) -> None:
        """Wait until every follower joined the group and proved it loaded the same model.

        :raises NodeLost: a follower did not join within ``dist_timeout``, or loaded another
            model (the message names the node and what differs).
        """
        self._make_group(self.host)
        assert self.listener is not None
        deadline = time.monotonic() + self.timeout_s
        pending = set(range(1, self.nnodes))
        #: connections that were not a follower's hello (a port scanner, a client of a
        #: process that had this port before): closed and ignored, named if the join times out
        strays: list[str] = []
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ignored = f"; ignored: {'; '.join(strays[-3:])}" if strays else ""
                raise NodeLost(
                    f"dist_init_addr {self.host}:{self.port}: follower node(s) {sorted(pending)} "
                    f"did not connect within {self.timeout_s:.0f}s; check they were started "
                    f"with this address and can reach it{ignored}"
                )
            self.listener.settimeout(remaining)
            try:
                conn, peer = self.listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(max(1.0, remaining))
            reader = conn.makefile("rb")
            try:
                hello = json.loads(reader.readline() or b"{}")
            except (OSError, ValueError) as exc:
                conn.close()
                strays.append(f"no hello from {peer[0]}:{peer[1]}: {exc}")
                continue
            rank = hello.get("node_rank") if isinstance(hello, dict) else None
            if not isinstance(hello, dict) or hello.get("event") != "hello":
                conn.close()
                strays.append(f"not a hello from {peer[0]}:{peer[1]}: {str(hello)[:80]}")
                continue
            if rank not in pending:
                conn.close()
                raise NodeLost(
                    f"dist_init_addr {self.host}:{self.port}: unexpected hello {hello!r} from "
                    f"{peer[0]} (expected node ranks {sorted(pending)})"
                )
            theirs = hello.get("fingerprint") or {}
            diff = {k: (v, theirs.get(k)) for k, v in mine.items() if theirs.get(k) != v}
            if diff:
                conn.close()
                raise NodeLost(
                    f"follower node {rank} (pid {hello.get('pid')} on {peer[0]}) loaded a "
                    f"different model than the head: {diff} (head, follower); start every node "
                    "with the same --model"
                )
            conn.settimeout(None)
            _keepalive(conn)
            pending.discard(rank)
            self._conns[rank] = conn
            self._readers[rank] = reader
            self.followers[rank] = {"node_rank": rank, "pid": hello.get("pid"), "host": peer[0]}
        for rank, conn in sorted(self._conns.items()):
            _send_line(conn, {"op": "welcome"})
            threading.Thread(
                target=self._watch,
                args=(rank, self._readers[rank]),
                name=f"relax-hf-node-{rank}",
                daemon=True,
            ).start()

    def _watch(self, rank: int, reader: Any) -> None:
        """Read what follower ``rank`` says; its connection closing means it is gone."""
        info = self.followers[rank]
        who = f"follower node {rank} (pid {info['pid']} on {info['host']})"
        try:
            for line in reader:
                event = json.loads(line)
                if event.get("event") == "error":
                    self.fail(f"{who} failed: {event.get('message')}")
        except (OSError, ValueError) as exc:
            self.fail(f"{who} is lost: {type(exc).__name__}: {exc}")
            return
        self.fail(f"{who} is lost: its connection to the head closed (the process died?)")

    def fail(self, reason: str) -> None:
        """Mark the group broken (the first reason is kept); call ``on_lost`` once."""
        with self._lock:
            if self.lost is not None or self._closing:
                return
            self.lost = reason
        log.error("relax-hf: multi-node replica unhealthy: %s", reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def _check(self) -> None:
        if self.lost is not None:
            raise NodeLost(self.lost)

    def send(self, op: str, **fields: Any) -> None:
        """Send one command to every follower. :raises NodeLost: the group is broken."""
        self._check()
        line = {"op": op, **fields}
        for rank, conn in sorted(self._conns.items()):
            try:
                _send_line(conn, line)
            except OSError as exc:
                self.fail(f"follower node {rank}: sending {op!r} failed: {exc}")
                raise NodeLost(self.lost) from exc

    def sync_tokens(self, tokens: list[int]) -> list[int]:
        """All-gather the tokens every node sampled; the head's are the step's tokens."""
        self._check()
        try:
            gathered = self._all_gather_tokens(tokens)
        except RuntimeError as exc:
            self.fail(f"a step's token exchange failed: {exc}")
            raise NodeLost(self.lost) from exc
        for theirs in gathered[1:]:
            self.diverged_tokens += sum(a != b for a, b in zip(tokens, theirs, strict=True))
        return tokens

    def send_tensors(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Relay a weight update: a ``load_tensors`` command, then the bytes by broadcast."""
        self.send(
            "load_tensors",
            names=[n for n, _ in named],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
            shapes=[list(t.shape) for _, t in named],
        )
        sizes = [t.numel() * t.element_size() for _, t in named]
        try:
            for bucket in _buckets(sizes):
                buf = torch.cat([_wire_bytes(named[i][1]) for i in bucket])
                self.pg.broadcast(buf, 0).wait()
        except RuntimeError as exc:
            self.fail(f"relaying a weight update to the followers failed: {exc}")
            raise NodeLost(self.lost) from exc

    def status(self) -> dict[str, Any]:
        """The group as ``/server_info`` reports it."""
        return {
            "nnodes": self.nnodes,
            "dist_init_addr": f"{self.host}:{self.port}",
            "followers": [dict(self.followers[r]) for r in sorted(self.followers)],
            "healthy": self.lost is None,
            "lost": self.lost,
            "steps_synced": self.steps,
            "tokens_synced": self.tokens_synced,
            "diverged_tokens": self.diverged_tokens,
            "mirrored": True,
        }

    def close(self) -> None:
        """Tell the followers to exit (best effort) and close every connection. Idempotent."""
        with self._lock:
            self._closing = True
        for conn in self._conns.values():
            try:
                _send_line(conn, {"op": "shutdown"})
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._conns.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None


class FollowerNode(_Group):
    """A follower's side (node rank > 0): joins the head, receives its commands.

    Build it with :meth:`connect` before loading the model and call :meth:`join` after; then
    read commands with :meth:`recv`. Every method raises :class:`NodeLost` once the head is
    gone.
    """

    def __init__(self, host: str, port: int, nnodes: int, rank: int, timeout_s: float) -> None:
        super().__init__(rank, nnodes, timeout_s)
        self.host, self.port = host, port
        self.conn: socket.socket | None = None
        self._lines: Any = None
        self.diverged_tokens = 0

    @classmethod
    def connect(
        cls, dist_init_addr: str | None, nnodes: int, rank: int, timeout_s: float
    ) -> FollowerNode:
        """Reach the head's rendezvous store (waits up to ``timeout_s`` for it to appear).

        :raises ValueError: a malformed address or rank. :raises NodeLost: no head in time.
        """
        import torch.distributed as dist

        if not 0 < rank < nnodes:
            raise ValueError(f"node_rank: a follower's rank must be in [1, {nnodes}), got {rank}")
        host, port = parse_dist_addr(dist_init_addr)
        node = cls(host, port, nnodes, rank, timeout_s)
        try:
            node.store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, nnodes, False, timeout=node.timeout
            )
        except Exception as exc:  # DistStoreError, RuntimeError, TimeoutError …
            raise NodeLost(
                f"dist_init_addr: no head answered at {host}:{port} within {timeout_s:.0f}s "
                f"({type(exc).__name__}: {exc}); start the head (node rank 0) with this address"
            ) from exc
        return node

    def join(self, mine: Mapping[str, Any]) -> None:
        """Join the group, introduce this node to the head and wait for its welcome.

        :raises NodeLost: the head refused this node (another model) or went away.
        """
        self._make_group(_route_ip(self.host))
        chost, _, cport = self.store.get(_CONTROL_KEY).decode().rpartition(":")
        conn = socket.create_connection((chost, int(cport)), timeout=self.timeout_s)
        _keepalive(conn)
        self.conn = conn
        self._lines = conn.makefile("rb")
        _send_line(
            conn,
            {"event": "hello", "node_rank": self.rank, "pid": os.getpid(), "fingerprint": mine},
        )
        welcome = self.recv()
        if welcome.get("op") != "welcome":
            raise NodeLost(f"the head answered {welcome!r} instead of a welcome")
        conn.settimeout(None)

    def recv(self) -> dict[str, Any]:
        """The next command from the head (blocks). :raises NodeLost: the head is gone."""
        try:
            line = self._lines.readline()
        except OSError as exc:
            raise NodeLost(f"the connection to the head failed: {exc}") from exc
        if not line:
            raise NodeLost(
                f"the head at {self.host}:{self.port} closed the connection (the head died?)"
            )
        return dict(json.loads(line))

    def sync_tokens(self, tokens: list[int]) -> list[int]:
        """All-gather the step's tokens; return the head's (the ones every node continues with)."""
        try:
            gathered = self._all_gather_tokens(tokens)
        except RuntimeError as exc:
            raise NodeLost(f"a step's token exchange with the head failed: {exc}") from exc
        head = gathered[0]
        self.diverged_tokens += sum(a != b for a, b in zip(tokens, head, strict=True))
        return head

    def receive_tensors(self, cmd: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """The tensors of a ``load_tensors`` command, received by broadcast from the head."""
        names = list(cmd["names"])
        dtypes = [parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(cmd["dtypes"])]
        shapes = [tuple(s) for s in cmd["shapes"]]
        sizes = [
            int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in zip(shapes, dtypes, strict=True)
        ]
        out: list[tuple[str, torch.Tensor]] = []
        try:
            for bucket in _buckets(sizes):
                buf = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
                self.pg.broadcast(buf, 0).wait()
                offset = 0
                for i in bucket:
                    raw = buf[offset : offset + sizes[i]].clone()
                    out.append((names[i], raw.view(dtypes[i]).reshape(shapes[i])))
                    offset += sizes[i]
        except RuntimeError as exc:
            raise NodeLost(f"receiving a weight update from the head failed: {exc}") from exc
        return out

    def report_error(self, message: str) -> None:
        """Tell the head why this follower is about to exit (best effort)."""
        if self.conn is not None:
            try:
                _send_line(self.conn, {"event": "error", "message": message})
            except OSError:
                pass
