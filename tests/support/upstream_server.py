"""A small real engine-protocol server the gateway tests put behind a gateway.

It speaks the parts of the SGLang HTTP protocol a gateway forwards (``/generate`` with and
without SSE, ``/v1/chat/completions`` with and without SSE, ``/health``, ``/v1/models``,
``/model_info``) and records what it received, so tests can check what the gateway sent. It is
a legitimate upstream, not a stand-in for the code under test: the gateway, the client and the
sockets between them are all real.

Run: ``python tests/upstream_server.py --port P --name NAME``; it prints ``READY`` once it
accepts connections. A test drives faults with the ``X-Test-Mode`` request header (forwarded by
the gateway like any end-to-end header):

- ``slow:S``        answer after S seconds;
- ``badjson``       answer 200 with a body that is not JSON;
- ``status:N``      answer status N with a JSON error body;
- ``hang-stream``   send one SSE event, then nothing until the client goes away;
- ``first-event-after:S``  send the stream's headers at once and its first event S seconds
                    later (an engine queueing and prefilling a long prompt);
- ``die-after:N``   send N SSE events, then kill this process (SIGKILL) mid-stream;
- ``reset-after:N`` send N SSE events, then drop the connection (the process lives on).

``GET /_last`` returns the last POST's path, headers and body; ``GET /_stats`` counts requests
and streams that ended because the client went away.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

STATE: dict[str, Any] = {"name": "upstream", "last": None, "requests": 0, "streams_closed_early": 0}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _record(request: Request) -> tuple[dict[str, Any], str]:
    raw = await request.body()
    body = json.loads(raw) if raw else {}
    STATE["requests"] += 1
    STATE["last"] = {
        "path": request.url.path,
        "headers": [[k, v] for k, v in request.headers.items()],
        "body": body,
        "raw": raw.decode("utf-8", "replace"),
    }
    return body, request.headers.get("x-test-mode", "")


async def _fault(mode: str) -> Response | None:
    if mode.startswith("slow:"):
        await asyncio.sleep(float(mode[5:]))
    elif mode == "badjson":
        return Response(b"<html>not json", media_type="application/json")
    elif mode.startswith("status:"):
        code = int(mode[7:])
        return JSONResponse(
            {"error": {"message": f"test upstream answered {code}"}}, status_code=code
        )
    return None


class _HangStream(Response):
    """Sends one event, then waits for the client to go away (and counts that it did)."""

    def __init__(self, first: bytes) -> None:
        super().__init__(media_type="text/event-stream")
        self.first = first

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        STATE["streams_closed_early"] += 1


async def _stream(events: list[bytes], mode: str) -> AsyncIterator[bytes]:
    try:
        for i, event in enumerate(events):
            if i == 0 and mode.startswith("first-event-after:"):
                await asyncio.sleep(float(mode[18:]))
            if mode.startswith("die-after:") and i == int(mode[10:]):
                os.kill(os.getpid(), signal.SIGKILL)
            if mode.startswith("reset-after:") and i == int(mode[12:]):
                # uvicorn closes a connection whose streamed response raised: cut mid-stream.
                raise ConnectionResetError("test upstream drops the connection mid-stream")
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        STATE["streams_closed_early"] += 1
        raise


def _generate_answer(body: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    ids = body.get("input_ids")
    prompt_tokens = len(ids) if isinstance(ids, list) else len(str(body.get("text", "")).split())
    return {
        "text": f"{STATE['name']}:token{i}" if n else f"{STATE['name']}:done",
        "output_ids": list(range(i + 1)),
        "meta_info": {
            "id": "rid",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": i + 1,
            "finish_reason": {"type": "length", "length": n} if i + 1 == n else None,
        },
    }


async def generate(request: Request) -> Response:
    body, mode = await _record(request)
    fault = await _fault(mode)
    if fault is not None:
        return fault
    n = min(int((body.get("sampling_params") or {}).get("max_new_tokens", 3) or 0), 20000)
    if body.get("stream"):
        events = [_sse(_generate_answer(body, i, n)) for i in range(max(n, 1))]
        events.append(b"data: [DONE]\n\n")
        if mode == "hang-stream":
            return _HangStream(events[0])
        return StreamingResponse(_stream(events, mode), media_type="text/event-stream")
    return JSONResponse(_generate_answer(body, max(n, 1) - 1, n))


async def chat(request: Request) -> Response:
    body, mode = await _record(request)
    fault = await _fault(mode)
    if fault is not None:
        return fault
    model = body.get("model", "unknown")
    n = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or 3), 20000)
    created = int(time.time())
    if body.get("stream"):
        events = []
        for i in range(n):
            chunk = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": f"tok{i} "}
                        if i == 0
                        else {"content": f"tok{i} "},
                        "finish_reason": "length" if i + 1 == n else None,
                    }
                ],
            }
            events.append(_sse(chunk))
        events.append(b"data: [DONE]\n\n")
        return StreamingResponse(_stream(events, mode), media_type="text/event-stream")
    content = " ".join(f"tok{i}" for i in range(n))
    return JSONResponse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"{STATE['name']}: {content}"},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
        }
    )


async def health(request: Request) -> Response:
    return Response(b"", status_code=200)


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": STATE["name"], "object": "model"}]})


async def model_info(request: Request) -> Response:
    return JSONResponse(
        {"model_path": STATE["name"], "is_generation": True, "weight_version": None}
    )


async def last(request: Request) -> Response:
    return JSONResponse(STATE["last"])


async def stats(request: Request) -> Response:
    return JSONResponse({k: STATE[k] for k in ("requests", "streams_closed_early")})


app = Starlette(
    routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health),
        Route("/health_generate", health),
        Route("/v1/models", models),
        Route("/model_info", model_info),
        Route("/_last", last),
        Route("/_stats", stats),
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="upstream")
    args = parser.parse_args()
    STATE["name"] = args.name
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")
    server = uvicorn.Server(config)

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.01)
        print("READY", flush=True)
        await task

    asyncio.run(run())
    sys.exit(0)


if __name__ == "__main__":
    main()
