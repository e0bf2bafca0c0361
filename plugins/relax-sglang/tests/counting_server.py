"""A small engine-protocol server that counts the generation POSTs it received, per ``rid``.

A real worker for a real router: it answers what sglang-router and smg probe when they register
a worker (``/health``, ``/server_info``, ``/model_info``, ``/v1/models``) and ``POST
/generate`` with a one-token answer (SSE when streamed). ``GET /_counts`` returns ``{rid:
POSTs received}``, so a test can tell from the worker side whether a router replayed a request,
and ``GET /_bodies`` ``{rid: the last body received}``.

Faults come in the request's ``rid`` (routers do not forward unknown headers, and sglang-router
drops unknown body fields; ``rid`` survives both):

- ``die:...``         the process SIGKILLs itself on receipt, before answering;
- ``die-mid-stream:...``  a streamed request gets one SSE event, then the process SIGKILLs
  itself (the worker dies mid-request).

Run: ``python counting_server.py PORT NAME``; ready once ``GET /health`` answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter

from aiohttp import web

COUNTS: Counter[str] = Counter()
BODIES: dict[str, object] = {}


def _answer(name: str, rid: str) -> dict[str, object]:
    return {
        "text": name,
        "output_ids": [1],
        "meta_info": {
            "id": rid,
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "finish_reason": {"type": "length", "length": 1},
        },
    }


def main() -> None:
    port, name = int(sys.argv[1]), sys.argv[2]
    info = {"model_path": name, "served_model_name": name, "is_generation": True}

    async def get(request: web.Request) -> web.StreamResponse:
        if request.path in ("/health", "/health_generate"):
            return web.Response()
        if request.path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            return web.json_response(info)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})
        if request.path == "/_counts":
            return web.json_response(dict(COUNTS))
        if request.path == "/_bodies":
            return web.json_response(BODIES)
        return web.json_response({"error": request.path}, status=404)

    async def post(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read() or b"{}")
        rid = str(body.get("rid"))
        COUNTS[rid] += 1
        BODIES[rid] = body
        if rid.startswith("die:"):
            os.kill(os.getpid(), signal.SIGKILL)
        answer = _answer(name, rid)
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(answer).encode() + b"\n\n")
        if rid.startswith("die-mid-stream:"):
            await asyncio.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/{tail:.*}", get)
    app.router.add_post("/{tail:.*}", post)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()
