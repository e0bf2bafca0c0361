"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` on the same scheduler.

Chat prompts are built with the tokenizer's chat template. ``stream: true`` answers OpenAI's
SSE chunks (text deltas) ending with ``data: [DONE]``. SGLang's extensions ``top_k``,
``min_p``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` and ``no_stop_trim`` are
accepted; ``n`` must be 1.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from relax_hf.engine import Engine
from relax_hf.protocol import BadRequest, LogprobParams, parse_sampling_params
from relax_hf.server import SSE_DONE, _engine, encode_prompt, read_json, sse

__all__ = ["chat_completions", "completions"]

_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "min_tokens": "min_new_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
}


def _finish(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type", ""), "abort")


def _common(engine: Engine, body: Any) -> tuple[Any, LogprobParams, bool, int]:
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    raw: dict[str, Any] = {}
    for key, target in _SAMPLING_KEYS.items():
        if body.get(key) is not None:
            raw[target] = body[key]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        raw["max_new_tokens"] = max_tokens
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("n", "only n=1 is supported by the hf engine")
    sampling = parse_sampling_params(raw, vocab_size=engine.runner.vocab_size, field="body")
    logprobs = body.get("logprobs")
    top = body.get("top_logprobs")
    want = bool(logprobs)
    if logprobs is not None and not isinstance(logprobs, bool | int):
        raise BadRequest("logprobs", "must be a boolean (chat) or an integer (completions)")
    k = int(
        top or (logprobs if isinstance(logprobs, int) and not isinstance(logprobs, bool) else 0)
    )
    if k < 0 or k > 20:
        raise BadRequest("top_logprobs", f"must be in [0, 20], got {k}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    return (
        sampling,
        LogprobParams(return_logprob=want, top_logprobs_num=k, return_text_in_logprobs=want),
        stream,
        k,
    )


def _chat_logprobs(meta: dict[str, Any]) -> dict[str, Any] | None:
    if "output_token_logprobs" not in meta:
        return None
    tops = meta.get("output_top_logprobs") or [None] * len(meta["output_token_logprobs"])
    content = []
    for (lp, _tid, text), top in zip(meta["output_token_logprobs"], tops, strict=True):
        content.append(
            {
                "token": text or "",
                "logprob": lp,
                "bytes": list((text or "").encode()),
                "top_logprobs": [
                    {"token": t or "", "logprob": v, "bytes": list((t or "").encode())}
                    for v, _i, t in (top or [])
                ],
            }
        )
    return {"content": content}


def _usage(meta: dict[str, Any]) -> dict[str, int]:
    p, c = meta["prompt_tokens"], meta["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    engine = _engine(request)
    body = await read_json(request)
    sampling, logprob, stream, _ = _common(engine, body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise BadRequest(f"messages[{i}]", "must be an object with string role and content")
    tok = engine.runner.tokenizer
    if not getattr(tok, "chat_template", None):
        raise BadRequest(
            "messages", "the model's tokenizer has no chat template; use /v1/completions"
        )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    model = engine.served_model_name
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if stream:
        seq, queue = engine.submit(ids, sampling, logprob, stream=True)
        return StreamingResponse(
            _chat_stream(engine, seq.rid, queue, cid, created, model),
            media_type="text/event-stream",
        )
    out = await engine.generate_one(ids, sampling, logprob)
    meta = out["meta_info"]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out["text"]},
        "logprobs": _chat_logprobs(meta),
        "finish_reason": _finish(meta["finish_reason"]),
        "matched_stop": meta["finish_reason"].get("matched"),
    }
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(meta),
            "weight_version": meta["weight_version"],
        }
    )


async def _deltas(
    engine: Engine, rid: str, queue: asyncio.Queue[dict[str, Any]]
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    sent = ""
    finished = False
    try:
        while not finished:
            snap = await queue.get()
            finished = snap["meta_info"]["finish_reason"] is not None
            text = snap["text"]
            # Hold back an incomplete UTF-8 character until the next token completes it.
            if not finished and text.endswith("\ufffd"):
                continue
            delta = text[len(sent) :] if text.startswith(sent) else text
            sent = text
            yield delta, snap
    finally:
        if not finished:
            engine.abort(rid, "Abort: the client went away")


async def _chat_stream(
    engine: Engine, rid: str, queue: Any, cid: str, created: int, model: str
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> bytes:
        return sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
                **extra,
            }
        )

    yield chunk({"role": "assistant", "content": ""}, None)
    async for delta, snap in _deltas(engine, rid, queue):
        meta = snap["meta_info"]
        finish = _finish(meta["finish_reason"])
        if delta:
            yield chunk({"content": delta}, None)
        if finish is not None:
            yield chunk({}, finish, usage=_usage(meta))
    yield SSE_DONE


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    engine = _engine(request)
    body = await read_json(request)
    sampling, logprob, stream, _ = _common(engine, body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        ids = encode_prompt(engine, prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if any(t < 0 or t >= engine.runner.vocab_size for t in prompt):
            raise BadRequest("prompt", f"token ids must be in [0, {engine.runner.vocab_size})")
        ids = list(prompt)
    else:
        raise BadRequest("prompt", "must be a non-empty string or a list of token ids")
    model = engine.served_model_name
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if stream:
        seq, queue = engine.submit(ids, sampling, logprob, stream=True)
        return StreamingResponse(
            _completion_stream(engine, seq.rid, queue, cid, created, model),
            media_type="text/event-stream",
        )
    out = await engine.generate_one(ids, sampling, logprob)
    meta = out["meta_info"]
    lp = None
    if "output_token_logprobs" in meta:
        lp = {
            "tokens": [t or "" for _v, _i, t in meta["output_token_logprobs"]],
            "token_logprobs": [v for v, _i, _t in meta["output_token_logprobs"]],
        }
    choice = {
        "index": 0,
        "text": out["text"],
        "logprobs": lp,
        "finish_reason": _finish(meta["finish_reason"]),
        "matched_stop": meta["finish_reason"].get("matched"),
    }
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(meta),
            "weight_version": meta["weight_version"],
        }
    )


async def _completion_stream(
    engine: Engine, rid: str, queue: Any, cid: str, created: int, model: str
) -> AsyncIterator[bytes]:
    async for delta, snap in _deltas(engine, rid, queue):
        meta = snap["meta_info"]
        finish = _finish(meta["finish_reason"])
        if delta or finish is not None:
            extra = {"usage": _usage(meta)} if finish is not None else {}
            yield sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
                    ],
                    **extra,
                }
            )
    yield SSE_DONE
