"""A lightweight SGLang-protocol engine server for the manager benchmark (run as a script).

It speaks the control protocol the InferenceManager drives — ``/health``,
``/health_generate``, ``/model_info``, ``/server_info``, ``/generate``, ``/flush_cache``,
``/abort_request``, ``/release_memory_occupation``, ``/resume_memory_occupation`` — over real
HTTP (aiohttp), and spends a fixed, per-tag time on each release and resume, as a GPU engine
spends its time in device copies rather than on the host CPU. That keeps a 16-engine benchmark
on a 2-core machine a measurement of the manager's fan-out, not of CPU contention between 16
model processes. ``--jitter-ms`` adds a stable per-engine delay so the replicas differ.

Multi-node: with ``--nnodes N``, node rank 0 (the head) listens on ``--dist-init-addr`` and
serves HTTP only once the N-1 followers (``--node-rank R``) have connected over TCP; a follower
that loses its head exits, and a head that loses a follower stops generating (its
``/health_generate`` answers 503), as a real multi-node engine's collective would fail.

``--request-log DIR`` appends the ``X-Request-ID`` of every ``/generate`` it receives to a file
of its own in DIR (one ``os.write`` per request to an ``O_APPEND`` file, so the record survives a
``kill -9``): the soak suite counts replays from them. ``/generate`` with ``"stream": true``
answers ``max_new_tokens`` SSE events, ``--stream-gap-ms`` apart.

``python _sim_engine.py --host H --port P --engine-id ID [--release-ms weights=120,...]``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys

from aiohttp import web

TAGS = ("weights", "kv_cache", "cuda_graph")


def _costs(text: str) -> dict[str, float]:
    out = dict.fromkeys(TAGS, 0.0)
    for part in filter(None, text.split(",")):
        tag, _, ms = part.partition("=")
        if tag not in out:
            raise SystemExit(f"unknown tag {tag!r} in {text!r}; known: {list(TAGS)}")
        out[tag] = float(ms) / 1000.0
    return out


class SimEngine:
    """Resident tags, a weight version and timed release/resume."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.broken: str | None = None
        self.release_s = _costs(args.release_ms)
        self.resume_s = _costs(args.resume_ms)
        digest = hashlib.sha256(args.engine_id.encode()).digest()
        self.jitter_s = (int.from_bytes(digest[:4], "big") % max(1, args.jitter_ms)) / 1000.0
        self.resident = dict.fromkeys(TAGS, True)
        self.version = args.weight_version
        self.lock = asyncio.Lock()
        self.log_fd: int | None = None
        if args.request_log:
            os.makedirs(args.request_log, exist_ok=True)
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.engine_id)
            path = os.path.join(args.request_log, f"{safe}-{os.getpid()}.log")
            self.log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def ok(self, **extra: object) -> web.Response:
        return web.json_response({"success": True, "message": "ok", **extra})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.broken:
            return web.json_response({"error": self.broken}, status=503)
        if not all(self.resident.values()):
            return web.json_response({"error": "memory released"}, status=503)
        await asyncio.sleep(self.args.generate_ms / 1000.0)
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": "sim", "is_generation": True, "weight_version": self.version}
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"engine_id": self.args.engine_id, "resident": self.resident})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.log_fd is not None:
            rid = request.headers.get("X-Request-ID", "-")
            os.write(self.log_fd, rid.encode("ascii", "replace") + b"\n")
        if self.broken:
            return web.json_response({"error": self.broken}, status=500)
        if not all(self.resident.values()):
            return web.json_response({"error": "memory released"}, status=400)
        body = json.loads(await request.read() or b"{}")
        await asyncio.sleep(self.args.generate_ms / 1000.0)
        meta = {"finish_reason": {"type": "length"}, "weight_version": self.version}
        if not body.get("stream"):
            return web.json_response({"text": "sim", "output_ids": [1], "meta_info": meta})
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or 1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(max(1, n)):
            if i:
                await asyncio.sleep(self.args.stream_gap_ms / 1000.0)
            event = {"text": "sim" * (i + 1), "output_ids": list(range(i + 1)), "meta_info": meta}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def nothing(self, request: web.Request) -> web.Response:
        return self.ok()

    async def _tags(self, request: web.Request) -> list[str]:
        body = json.loads(await request.read() or b"{}")
        tags = body.get("tags")
        return list(TAGS) if tags is None else [str(t) for t in tags]

    async def release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        async with self.lock:
            todo = [t for t in tags if self.resident[t]]
            await asyncio.sleep(
                sum(self.release_s[t] for t in todo) + (self.jitter_s if todo else 0)
            )
            for t in tags:
                self.resident[t] = False
        return self.ok(tags=tags)

    async def resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        async with self.lock:
            todo = [t for t in tags if not self.resident[t]]
            await asyncio.sleep(
                sum(self.resume_s[t] for t in todo) + (self.jitter_s if todo else 0)
            )
            for t in tags:
                self.resident[t] = True
        return self.ok(tags=tags)

    def app(self) -> web.Application:
        app = web.Application()
        get_post = ("GET", "POST")
        for path, handler, methods in (
            ("/health", self.health, get_post),
            ("/health_generate", self.health_generate, get_post),
            ("/model_info", self.model_info, ("GET",)),
            ("/get_model_info", self.model_info, ("GET",)),
            ("/server_info", self.server_info, ("GET",)),
            ("/generate", self.generate, ("POST",)),
            ("/flush_cache", self.nothing, get_post),
            ("/abort_request", self.nothing, ("POST",)),
            ("/release_memory_occupation", self.release, ("POST",)),
            ("/resume_memory_occupation", self.resume, ("POST",)),
        ):
            for method in methods:
                app.router.add_route(method, path, handler)
        return app


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def _serve_head(engine: SimEngine, args: argparse.Namespace) -> None:
    """Wait for every follower, then serve HTTP; watch the followers' connections."""
    joined: dict[int, asyncio.StreamReader] = {}
    everyone = asyncio.Event()

    async def follower(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = int((await reader.readline()).decode().strip() or -1)
        joined[rank] = reader
        if len(joined) == args.nnodes - 1:
            everyone.set()
        await reader.read()  # EOF: the follower is gone
        engine.broken = f"node rank {rank} left the group"
        writer.close()

    if args.nnodes > 1:
        host, port = _split(args.dist_init_addr)
        server = await asyncio.start_server(follower, host, port)
        await everyone.wait()
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    await asyncio.Event().wait()
    if args.nnodes > 1:
        server.close()


async def _follow(args: argparse.Namespace) -> int:
    """Join the head's group; exit when the head goes away."""
    host, port = _split(args.dist_init_addr)
    for _ in range(600):
        try:
            reader, writer = await asyncio.open_connection(host, port)
            break
        except OSError:
            await asyncio.sleep(0.1)
    else:
        return 2
    writer.write(f"{args.node_rank}\n".encode())
    await writer.drain()
    await reader.read()
    return 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--release-ms", default="weights=120,kv_cache=40,cuda_graph=10")
    parser.add_argument("--resume-ms", default="weights=150,kv_cache=40,cuda_graph=30")
    parser.add_argument("--generate-ms", type=float, default=10.0)
    parser.add_argument("--jitter-ms", type=int, default=20)
    parser.add_argument("--weight-version", default="sim-0")
    parser.add_argument("--request-log", default=None, help="append request ids to DIR/…")
    parser.add_argument("--stream-gap-ms", type=float, default=5.0)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", default=None)
    args = parser.parse_args(argv)
    if args.nnodes > 1 and not args.dist_init_addr:
        parser.error("--nnodes > 1 needs --dist-init-addr HOST:PORT")
    if args.node_rank > 0:
        return asyncio.run(_follow(args))
    asyncio.run(_serve_head(SimEngine(args), args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
