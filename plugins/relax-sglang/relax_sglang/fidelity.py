"""Field fidelity: the request fields a router must forward unchanged, and the probe that checks.

sglang-router re-serialises a ``/generate`` body and drops every field it does not know (0.3.2
drops ``return_routed_experts``, ``sampling_params.logit_bias``, …), silently: an RL rollout
would lose its routing replay or its logit bias and nobody would see it. So every router is
probed when it starts: :class:`ProbeServer` registers with it as a worker that records what it
receives, :data:`PROBES` (every field Relax's roles send, with values no default equals) go
through the router, and :func:`compare` lists each field that did not arrive as sent.

The probe server speaks just enough of SGLang's protocol for a router to register it
(``/health``, ``/server_info``, ``/model_info``, ``/v1/models``, …) and answers every generation
with a one-token result (SSE when streamed). It runs on a private event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

__all__ = ["PROBES", "ProbeServer", "compare", "field_paths"]

# Every SGLang sampling parameter a caller can set (sglang.srt.sampling.sampling_params), each
# with a value its default does not have, so "dropped and defaulted" cannot pass for "kept".
_SAMPLING_PARAMS: dict[str, Any] = {
    "max_new_tokens": 3,
    "min_new_tokens": 1,
    "stop": ["</probe>"],
    "stop_token_ids": [7],
    "stop_regex": ["probe+"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.2,
    "repetition_penalty": 1.1,
    "n": 1,
    "json_schema": '{"type": "object"}',
    "regex": "a+",
    "ebnf": 'root ::= "a"',
    "structural_tag": '{"type": "probe"}',
    "ignore_eos": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "no_stop_trim": True,
    "stream_interval": 2,
    "logit_bias": {"5": 1.5},
    "sampling_seed": 1234,
    "custom_params": {"probe": 1},
}

# The other fields of SGLang's GenerateReqInput the roles send: log-prob options (teacher
# prefill, rollout log-probs), the request id, images, MoE routing replay, LoRA, streaming.
_COMMON: dict[str, Any] = {
    "sampling_params": _SAMPLING_PARAMS,
    "return_logprob": True,
    "logprob_start_len": 1,
    "top_logprobs_num": 2,
    "token_ids_logprob": [4, 5],
    "return_text_in_logprobs": True,
    "image_data": ["data:image/png;base64,iVBORw0KGgo="],
    "return_routed_experts": True,
    "lora_path": "probe-adapter",
}

#: The probe bodies sent through a router at start: one with ``text`` streamed, one with
#: ``input_ids`` not streamed; together they carry every field the roles send.
PROBES: tuple[dict[str, Any], ...] = (
    {"text": "relax field probe", "stream": True, "rid": "relax-probe-text", **_COMMON},
    {"input_ids": [11, 12, 13], "stream": False, "rid": "relax-probe-ids", **_COMMON},
)


class _GrpcPreface(logging.Filter):
    """Drops the one error smg's registration provokes: it tries gRPC first (an HTTP/2
    preface, ``PRI * HTTP/2.0``), which the HTTP/1.1 probe refuses, then falls back to HTTP."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


_LOG = logging.getLogger("relax_sglang.probe")
_LOG.addFilter(_GrpcPreface())


def field_paths(body: Mapping[str, Any]) -> list[str]:
    """Dotted paths of ``body``'s fields, one level into ``sampling_params``."""
    out = []
    for key, value in body.items():
        if key == "sampling_params" and isinstance(value, Mapping):
            out += [f"sampling_params.{k}" for k in value]
        else:
            out.append(key)
    return out


def _get(body: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = body
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _f32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _same(want: Any, got: Any) -> bool:
    # sglang-router 0.3.2 in PD mode re-serialises floats as float32 (0.1 arrives as
    # 0.10000000149011612); SGLang samples in float32, so that is the same value to it.
    if isinstance(want, float) and isinstance(got, float):
        return want == got or _f32(want) == _f32(got)
    return bool(want == got)


def compare(sent: Mapping[str, Any], received: Mapping[str, Any] | None) -> dict[str, str]:
    """Each field of ``sent`` that did not arrive as sent → ``"dropped"`` or
    ``"changed to <value>"`` (fields a router adds are ignored; a float equal at float32
    precision, the precision SGLang samples with, counts as the same)."""
    if received is None:
        return {path: "dropped" for path in field_paths(sent)}
    out = {}
    for path in field_paths(sent):
        _, want = _get(sent, path)
        found, got = _get(received, path)
        if not found:
            out[path] = "dropped"
        elif not _same(want, got):
            out[path] = f"changed to {json.dumps(got)[:80]}"
    return out


def _answer(body: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "text": "probe",
        "output_ids": [1],
        "meta_info": {
            "id": str(body.get("rid") or "probe"),
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "finish_reason": {"type": "length", "length": 1},
        },
    }


class ProbeServer:
    """Workers that record every generation request a router forwards to them.

    ``ProbeServer(modes=("regular",))`` serves one worker; ``modes=("prefill", "decode")`` two
    (a PD router needs one of each; the prefill one announces ``bootstrap_port``); they report
    ``served_model_name`` and ``model_path`` as the model's heads do. Use as a context manager,
    or :meth:`start` / :meth:`stop`. Blocking, thread-safe.
    """

    def __init__(
        self,
        modes: Sequence[str] = ("regular",),
        *,
        host: str = "127.0.0.1",
        served_model_name: str | None = None,
        model_path: str | None = None,
    ) -> None:
        self.modes = tuple(modes)
        self.host = host
        # Report the heads' own identity: a router that saw a second model would treat every
        # request differently (smg 1.13 then drops some sampling parameters).
        self.served_model_name = served_model_name or model_path or "relax-field-probe"
        self.model_path = model_path or self.served_model_name
        self.urls: list[str] = []
        self.bootstrap_port = 1
        self._received: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="probe")
        self._runners: list[web.AppRunner] = []

    def __enter__(self) -> ProbeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 10.0) -> list[str]:
        """Serve every worker on a free port; return their base URLs."""
        self._thread.start()
        for mode in self.modes:
            future = asyncio.run_coroutine_threadsafe(self._serve(mode), self._loop)
            self.urls.append(future.result(timeout))
        return list(self.urls)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every worker and the loop. Idempotent."""
        if not self._thread.is_alive():
            return

        async def cleanup() -> None:
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop.close()

    def received(self, rid: str) -> list[dict[str, Any]]:
        """Every body a worker received with this ``rid`` (one per worker it reached)."""
        with self._lock:
            return copy.deepcopy(self._received.get(rid, []))

    def worker_type(self, url: str) -> str:
        """``regular``, ``prefill`` or ``decode``: the kind of the worker at ``url``."""
        return self.modes[self.urls.index(url)]

    async def _serve(self, mode: str) -> str:
        info = {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "disaggregation_mode": "null" if mode == "regular" else mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
        }

        async def get(request: web.Request) -> web.StreamResponse:
            path = request.path
            if path in ("/health", "/health_generate"):
                return web.Response(status=200)
            if path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
                return web.json_response(info)
            if path == "/v1/models":
                return web.json_response(
                    {"object": "list", "data": [{"id": self.served_model_name, "object": "model"}]}
                )
            if path in ("/loads", "/get_load"):
                return web.json_response([])
            return web.json_response({"error": f"{path} is not served by the probe"}, status=404)

        async def post(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                return web.json_response({"error": "not JSON"}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": "not a JSON object"}, status=400)
            with self._lock:
                self._received.setdefault(str(body.get("rid")), []).append(body)
            answer = _answer(body)
            if body.get("stream"):
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(b"data: " + json.dumps(answer).encode() + b"\n\n")
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            return web.json_response(answer)

        app = web.Application()
        app.router.add_get("/{tail:.*}", get)
        app.router.add_post("/{tail:.*}", post)
        # Bind the socket here, so the port the OS picked is read from it.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.setblocking(False)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, logger=_LOG)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runners.append(runner)
        return f"http://{self.host}:{sock.getsockname()[1]}"
