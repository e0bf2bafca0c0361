"""A follower of a multi-node hf replica: ``relax-hf serve --node-rank K`` with K > 0.

A follower has no public HTTP API. It answers one private readiness URL on loopback
(``http://127.0.0.1:PORT/health``: 503 while joining, 200 once the head welcomed it) so the
process that started it knows when it has joined. It loads the same model as the head, joins the
head's node group (:mod:`relax_hf.nodes`) and then replays every command the head sends: each
scheduled step on its own copy of the batch (same sequences, same seeds, same aborts; tokens
exchanged with the head after every sampling), and every lifecycle operation (release, resume,
flush, weight loads). It does not shard the model: it mirrors the head.

Exit codes: 0 when the head shuts the replica down, 1 when the head is lost (its connection
closed or a collective failed), 2 when an operation failed here (the head is told why first and
reports the replica unhealthy).
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from typing import Any

from relax_hf.batch import Batch, Sequence
from relax_hf.nodes import FollowerNode, NodeLost, fingerprint
from relax_hf.runner import ModelRunner

__all__ = ["Follower", "ReadinessServer", "run_follower"]

log = logging.getLogger(__name__)

EXIT_SHUTDOWN, EXIT_HEAD_LOST, EXIT_FAILED = 0, 1, 2


class ReadinessServer:
    """``GET /health`` on loopback: 503 with the current state until :meth:`ready`, then 200."""

    def __init__(self, port: int) -> None:
        self.state = "joining"
        self.ready_flag = False
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/health":
                    self.send_error(404, "a follower serves only /health")
                    return
                body = json.dumps({"ready": owner.ready_flag, "state": owner.state}).encode()
                self.send_response(200 if owner.ready_flag else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # readiness polls are not worth a log line each

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(
            target=self.httpd.serve_forever, name="relax-hf-readiness", daemon=True
        ).start()

    def set(self, state: str, *, ready: bool = False) -> None:
        """Report ``state`` (and readiness) from now on."""
        self.state, self.ready_flag = state, ready

    def close(self) -> None:
        """Stop answering."""
        self.httpd.shutdown()
        self.httpd.server_close()


class Follower:
    """Replays the head's commands on this node's model (one thread: the caller's)."""

    def __init__(self, runner: ModelRunner, node: FollowerNode) -> None:
        self.runner = runner
        self.node = node
        self.batch = Batch(runner)
        self.batch.sync_tokens = node.sync_tokens
        self.parked: dict[str, Sequence] = {}  # retracted sequences waiting to run again
        self.commands = 0

    def serve(self) -> int:
        """Run commands until the head shuts down (0) or is lost (1), or one fails here (2)."""
        while True:
            cmd: dict[str, Any] = {}
            try:
                cmd = self.node.recv()
                if cmd.get("op") == "shutdown":
                    log.warning("relax-hf follower %d: the head shut down", self.node.rank)
                    return EXIT_SHUTDOWN
                self.run(cmd)
                self.commands += 1
            except NodeLost as exc:
                print(
                    f"relax-hf follower node {self.node.rank}: lost the head: {exc}; exiting",
                    flush=True,
                )
                return EXIT_HEAD_LOST
            except Exception as exc:  # anything else leaves this node out of step: report, exit
                message = f"{cmd.get('op')!r} failed: {type(exc).__name__}: {exc}"
                print(f"relax-hf follower node {self.node.rank}: {message}; exiting", flush=True)
                self.node.report_error(message)
                return EXIT_FAILED

    def _new(self, wires: list[dict[str, Any]]) -> list[Sequence]:
        seqs = []
        for wire in wires:
            if wire["retracted"]:
                seq = self.parked.pop(wire["rid"], None)
                if seq is None:
                    raise NodeLost(f"the head resumed request {wire['rid']!r} this node never ran")
            else:
                seq = Sequence.from_wire(wire)
            seqs.append(seq)
        return seqs

    def run(self, cmd: dict[str, Any]) -> None:
        """Apply one command from the head (see :mod:`relax_hf.nodes` for the list)."""
        op = cmd["op"]
        for rid in cmd.get("forget", ()):
            self.parked.pop(rid, None)
        if op == "step":
            self.batch.step(self._new(cmd["new"]), cmd["aborted"])
        elif op == "drop":
            self.batch.drop_aborted(cmd["aborted"])
        elif op == "retract":
            for seq in self.batch.retract(cmd["aborted"]):
                if not seq.finished:
                    self.parked[seq.rid] = seq
        elif op == "release":
            self.batch.clear()
            self.runner.release(cmd["tags"])
        elif op == "resume":
            self.runner.resume(cmd["tags"], graphs=cmd["graphs"])
        elif op == "reload":
            self.runner.reload_pending()
        elif op == "flush":
            self.runner.flush_cache()  # as the head
        elif op == "load_tensors":
            self.runner.load_named_tensors(self.node.receive_tensors(cmd), "names")
        elif op == "load_disk":
            self.runner.load_from_disk(cmd["path"])
        else:
            raise NodeLost(f"unknown command {op!r} from the head (a different relax-hf version?)")


def run_follower(config: Any) -> int:
    """Join the head at ``config.dist_init_addr`` as ``config.node_rank`` and mirror it.

    ``config`` is a :class:`~relax_hf.server.ServerConfig`; ``config.port`` is the private
    readiness port (bound on 127.0.0.1). Returns the process exit code.
    """
    readiness = ReadinessServer(config.port)
    start = time.monotonic()
    try:
        node = FollowerNode.connect(
            config.dist_init_addr, config.nnodes, config.node_rank, config.dist_timeout
        )
        readiness.set("loading the model")
        runner = ModelRunner.from_config(config)
        readiness.set("joining the head's node group")
        try:
            node.join(fingerprint(runner))
        except NodeLost:
            raise
        except (RuntimeError, OSError) as exc:  # gloo's rendezvous errors, a refused connection
            raise NodeLost(
                f"joining the head at {config.dist_init_addr} failed: {type(exc).__name__}: {exc}"
            ) from exc
    except NodeLost as exc:
        print(f"relax-hf follower node {config.node_rank}: {exc}", flush=True)
        readiness.close()
        return EXIT_HEAD_LOST
    except BaseException:
        readiness.close()
        raise
    readiness.set("ready", ready=True)
    print(
        f"relax-hf follower node {config.node_rank}/{config.nnodes}: joined the head at "
        f"{config.dist_init_addr} in {time.monotonic() - start:.1f}s",
        flush=True,
    )
    try:
        return Follower(runner, node).serve()
    finally:
        readiness.close()
