"""The OpenAI Responses API: ``POST /v1/responses`` (streamed or not), ``GET /v1/responses/{id}``.

A request's ``instructions`` (a system message), the conversation of its
``previous_response_id`` and its ``input`` (a string, or message items whose content is a
string or ``input_text`` / ``output_text`` parts; role ``developer`` is a system message)
become one chat through the tokenizer's chat template, and the answer is one assistant
``message`` item with one ``output_text`` part. Sampling maps as SGLang's does
(``max_output_tokens``, ``temperature``, ``top_p`` and SGLang's ``top_k``, ``min_p``,
``repetition_penalty``, penalties, ``stop``); ``text.format`` ``json_schema`` /
``json_object`` constrain the output. A finish by length answers ``status: "incomplete"``
(``incomplete_details.reason: "max_output_tokens"``); an aborted one ``"failed"``.

Stored responses (``store``, default true, as SGLang's) live in a bounded in-memory store of
the last :data:`STORE_LIMIT`: ``GET /v1/responses/{id}`` returns one, and
``previous_response_id`` continues its conversation (through the prefix cache, the history
is not prefilled again). The store is lost when the engine stops.

Refused with 400, never ignored: ``tools`` and a ``tool_choice`` that needs them (the engine
parses no tool calls), ``background``, ``reasoning`` with an effort or summary (no reasoning
parser), ``include`` entries, ``top_logprobs``, ``truncation: "auto"`` and input items
other than messages. Errors use the Responses API's nested ``error`` object.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from relax_hf.engine import Engine
from relax_hf.openai_api import chat_prompt_ids, openai_sampling
from relax_hf.protocol import BadRequest, LogprobParams, NotFound, SamplingParams
from relax_hf.wire import check_total_tokens, engine_of, read_json

__all__ = ["STORE_LIMIT", "ResponseStore", "create_response", "retrieve_response"]

#: Stored responses kept at most (the oldest goes first).
STORE_LIMIT = 256

#: Request fields passed to the sampling parameters under their chat-completion names.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
)


@attrs.define
class ResponseStore:
    """The last :data:`STORE_LIMIT` stored responses, each with the conversation it ended
    (its messages and its answer, without its ``instructions``, which do not carry over)."""

    limit: int = STORE_LIMIT
    entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, str]]]] = attrs.field(
        factory=OrderedDict
    )

    def put(self, response: dict[str, Any], conversation: list[dict[str, str]]) -> None:
        """Keep ``response``; the oldest entry goes when the store is full."""
        self.entries[response["id"]] = (response, conversation)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def get(
        self, response_id: str, field: str = "response_id"
    ) -> tuple[dict[str, Any], list[dict[str, str]]]:
        """A stored response and its conversation.

        :raises BadRequest: naming ``field``, an id that is not a response's (SGLang's words:
            every response id begins with ``resp_``).
        :raises NotFound: no such response (any more).
        """
        if not response_id.startswith("resp_"):
            raise BadRequest(
                field,
                f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
            )
        entry = self.entries.get(response_id)
        if entry is None:
            raise NotFound(
                f"Response with id '{response_id}' not found.",
                param="response_id",
                code="response_not_found",
            )
        return entry


def store_of(request: Request) -> ResponseStore:
    """The app's response store (made on first use)."""
    state = request.app.state
    store = getattr(state, "responses", None)
    if store is None:
        store = state.responses = ResponseStore()
    assert isinstance(store, ResponseStore)
    return store


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("tools"):
        raise BadRequest(
            "tools", "the hf engine parses no tool calls; describe tools in the input instead"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice", "needs tools, which the hf engine does not support")
    if body.get("background"):
        raise BadRequest("background", "background responses are not supported by the hf engine")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and any(reasoning.get(k) for k in ("effort", "summary")):
        raise BadRequest("reasoning", "the hf engine runs no reasoning parser; leave it unset")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise BadRequest("reasoning", "must be an object")
    if body.get("include"):
        raise BadRequest("include", "the hf engine adds nothing to a response; leave it empty")
    if body.get("top_logprobs"):
        raise BadRequest("top_logprobs", "log-probs are not returned by /v1/responses here")
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest("truncation", "only 'disabled': the hf engine does not truncate input")


def _content(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise BadRequest(f"{field}[{i}]", "only text parts (input_text, output_text)")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(field, "must be a string or a list of text parts")


def _input_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input", "must be a string or a non-empty list of message items")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}]", "must be a message object")
        kind = item.get("type", "message")
        if kind != "message":
            raise BadRequest(f"input[{i}].type", f"{kind!r} items are not supported; only messages")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise BadRequest(f"input[{i}].role", "must be user, assistant, system or developer")
        text = _content(item.get("content"), f"input[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


def _sampling(engine: Engine, body: dict[str, Any]) -> SamplingParams:
    chat: dict[str, Any] = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    chat["max_tokens"] = body.get("max_output_tokens")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": fmt}
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        chat["response_format"] = {"type": fmt["type"]}
    elif fmt is not None:
        raise BadRequest("text.format.type", "must be text, json_object or json_schema")
    try:
        return openai_sampling(engine, chat, None)
    except BadRequest as exc:
        field = {"max_tokens": "max_output_tokens", "response_format": "text.format"}.get(
            exc.field, exc.field
        )
        raise BadRequest(field, exc.message) from exc


def _status(finish: dict[str, Any]) -> str:
    kind = finish.get("type")
    return {"length": "incomplete", "abort": "failed"}.get(kind or "", "completed")


def _response(
    body: dict[str, Any],
    *,
    rid: str,
    created: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    fmt = body.get("text") if isinstance(body.get("text"), dict) else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": None,
        "store": body.get("store", True) is not False,
        "temperature": body.get("temperature"),
        "text": fmt or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
        "usage": usage,
    }


def _message(mid: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": mid,
        "status": "completed" if status == "completed" else "incomplete",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _usage(meta: dict[str, Any]) -> dict[str, Any]:
    p, c = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": meta["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": p + c,
    }


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    engine = engine_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    _refuse_unsupported(body)
    store = store_of(request)
    history: list[dict[str, str]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise BadRequest("previous_response_id", "must be a string")
        history = list(store.get(previous, "previous_response_id")[1])
    if body.get("input") is None:
        raise BadRequest("input", "is required")
    conversation = history + _input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions", "must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    ids = chat_prompt_ids(engine, {"messages": system + conversation})
    sampling = _sampling(engine, body)
    if body.get("max_output_tokens") is not None:
        check_total_tokens(engine, len(ids), sampling.max_new_tokens, "max_output_tokens")
    if sampling.n != 1:
        raise BadRequest("n", "a response has one output")
    await engine.check_grammar(sampling, "text.format")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    created, model = int(time.time()), engine.served_model_name
    keep = body.get("store", True) is not False

    def finish(text: str, meta: dict[str, Any]) -> dict[str, Any]:
        reason = meta["finish_reason"]
        status = _status(reason)
        error = None
        if status == "failed":
            error = {"code": "server_error", "message": str(reason.get("message", "aborted"))}
        output = [_message(mid, text, status)]
        response = _response(
            body,
            rid=rid,
            created=created,
            model=model,
            status=status,
            output=output,
            usage=_usage(meta),
            error=error,
        )
        if keep:
            store.put(response, [*conversation, {"role": "assistant", "content": text}])
        return response

    if not stream:
        out = await engine.generate_one(ids, sampling, LogprobParams())
        return JSONResponse(finish(out["text"], out["meta_info"]))
    subs = engine.submit(ids, sampling, LogprobParams(), stream=True, field="")
    seq, queue = subs[0]

    async def events() -> AsyncIterator[bytes]:
        number = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal number
            payload = {"type": kind, "sequence_number": number, **fields}
            number += 1
            return f"event: {kind}\ndata: {_dumps(payload)}\n\n".encode()

        start = _response(
            body, rid=rid, created=created, model=model, status="in_progress", output=[], usage=None
        )
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {**_message(mid, "", "in_progress"), "status": "in_progress", "content": []}
        done = False
        try:
            yield event("response.created", response=start)
            yield event("response.in_progress", response=start)
            yield event("response.output_item.added", output_index=0, item=item)
            yield event("response.content_part.added", **where, part=empty)
            sent = ""
            while True:
                snap = await queue.get()
                meta, text = snap["meta_info"], snap["text"]
                final = meta["finish_reason"] is not None
                if final or not text.endswith("\ufffd"):  # a whole UTF-8 character only
                    delta = text[len(sent) :] if text.startswith(sent) else text
                    if delta:
                        yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
                    sent = text
                if final:
                    break
            done = True
            response = finish(sent, meta)
            message = response["output"][0]
            yield event("response.output_text.done", **where, text=sent, logprobs=[])
            yield event("response.content_part.done", **where, part=message["content"][0])
            yield event("response.output_item.done", output_index=0, item=message)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
            yield event(kind.get(response["status"], "response.failed"), response=response)
        finally:
            if not done:
                engine.abort(seq.rid, "Abort: the client went away")

    return StreamingResponse(events(), media_type="text/event-stream")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


async def retrieve_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response."""
    response_id = request.path_params["response_id"]
    return JSONResponse(store_of(request).get(response_id)[0])
