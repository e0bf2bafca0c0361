"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` on the same scheduler.

The request fields map to SGLang sampling parameters as SGLang's own OpenAI server maps them
(``max_tokens``/``max_completion_tokens`` → ``max_new_tokens``, ``min_tokens`` →
``min_new_tokens``, ``seed`` → ``sampling_seed``, ``response_format`` → ``json_schema`` /
``structural_tag``; SGLang's extensions ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``stop_regex``, ``regex``, ``ebnf``, ``json_schema``, ``ignore_eos``,
``skip_special_tokens``, ``no_stop_trim``, ``custom_params`` pass through). ``n`` samples of a
prompt share one prefill; ``/v1/completions`` also takes a list of prompts (the choices are
numbered prompt by prompt) and ``echo`` (the prompt, with its log-probs when ``logprobs`` is
set: the way to score given continuations). Chat prompts are built with the tokenizer's chat
template, which gets the request's ``tools`` as SGLang's does (none for ``tool_choice:
"none"``); no tool call is parsed from the answer. ``stream: true`` answers OpenAI's SSE
chunks (text deltas per choice) ending with ``data: [DONE]``; ``stream_options`` adds a last
usage chunk (``include_usage``) or each choice's usage so far to its chunks
(``continuous_usage_stats``), and ``echo`` streams too (the prompt leads each choice's first
chunk). With ``--enable-cache-report`` every ``usage`` has
``prompt_tokens_details.cached_tokens`` (SGLang's). Fields OpenAI clients add that change
nothing here (``user``, …) are ignored.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from relax_hf.engine import Engine
from relax_hf.protocol import (
    BadRequest,
    LogprobParams,
    SamplingParams,
    parse_sampling_params,
)
from relax_hf.wire import (
    SSE_DONE,
    AnswerResponse,
    check_total_tokens,
    encode_prompt,
    engine_of,
    read_json,
    sse,
)

__all__ = [
    "chat_completions",
    "chat_prompt_ids",
    "completions",
    "openai_sampling",
    "template_tools",
]

#: OpenAI field -> SGLang sampling parameter.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "seed": "sampling_seed",
    "n": "n",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "min_tokens": "min_new_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "regex": "regex",
    "ebnf": "ebnf",
    "json_schema": "json_schema",
    "custom_params": "custom_params",
    "watermark": "watermark",
}
_OPENAI_NAME = {v: k for k, v in _SAMPLING_KEYS.items()}


def _finish(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type", ""), "abort")


def _response_format(body: dict[str, Any], raw: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in (
        "text",
        "json_object",
        "json_schema",
        "structural_tag",
    ):
        raise BadRequest(
            "response_format.type", "must be text, json_object, json_schema or structural_tag"
        )
    kind = fmt["type"]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadRequest(
                "response_format.json_schema.schema",
                "is required: an object holding the JSON schema",
            )
        raw["json_schema"] = json.dumps(spec["schema"])
    elif kind == "json_object":
        raw["json_schema"] = '{"type": "object"}'
    elif kind == "structural_tag":
        raw["structural_tag"] = json.dumps(fmt)


def openai_sampling(
    engine: Engine, body: dict[str, Any], default_max: int | None
) -> SamplingParams:
    """The sampling parameters of an OpenAI request body (SGLang's mapping). :raises
    BadRequest: naming the OpenAI field."""
    raw: dict[str, Any] = {}
    for key, target in _SAMPLING_KEYS.items():
        if body.get(key) is not None:
            raw[target] = body[key]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw["max_new_tokens"] = default_max if max_tokens is None else max_tokens
    _response_format(body, raw)
    grammars = [k for k in ("regex", "ebnf", "json_schema", "structural_tag") if k in raw]
    if len(grammars) > 1:
        raise BadRequest("response_format", f"cannot be combined with {grammars[0]}")
    try:
        return parse_sampling_params(raw, vocab_size=engine.runner.vocab_size, field="")
    except BadRequest as exc:
        name = exc.field.split(".", 1)[0]
        field = exc.field.replace(name, _OPENAI_NAME.get(name, name), 1)
        if name == "max_new_tokens":
            field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if name in ("json_schema", "structural_tag") and "response_format" in body:
            field = "response_format"
        raise BadRequest(field, exc.message) from exc


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(key, "must be true or false")
    return value


def _cache_report(request: Request) -> bool:
    """Whether ``usage`` reports ``prompt_tokens_details`` (the server's
    ``--enable-cache-report``, SGLang's flag)."""
    return bool(request.app.state.config.enable_cache_report)


def _usage(metas: list[dict[str, Any]], n: int, *, cached: bool) -> dict[str, Any]:
    """OpenAI's ``usage`` of ``metas`` (prompt by prompt, ``n`` samples each), as SGLang counts
    it: the samples of a prompt share its prefill, so its tokens and, with ``cached``, its
    ``cached_tokens`` are read once, from its first sample."""
    firsts = metas[::n]
    p = sum(m["prompt_tokens"] for m in firsts)
    c = sum(m["completion_tokens"] for m in metas)
    usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": sum(m["cached_tokens"] for m in firsts)}
    return usage


@attrs.frozen
class _StreamUsage:
    """What usage a stream carries (``stream_options``; SGLang's reading of them).

    ``final``: one last chunk without choices holds the whole request's usage
    (``include_usage``). ``continuous``: a choice's chunks hold its own usage so far
    (``continuous_usage_stats``). ``cached``: both report ``prompt_tokens_details``
    (``--enable-cache-report``).
    """

    final: bool = False
    continuous: bool = False
    cached: bool = False

    def of_choice(self, meta: dict[str, Any], *, opening: bool = False) -> dict[str, Any]:
        """The ``usage`` field of a chunk of the choice ``meta`` describes (none unless
        continuous); ``opening``: sent before any of its tokens (its role chunk)."""
        if not self.continuous:
            return {}
        if opening:
            meta = {**meta, "completion_tokens": 0}
        return {"usage": _usage([meta], 1, cached=self.cached)}


def openai_processor(engine: Engine, body: dict[str, Any]) -> str | None:
    """The body's ``custom_logit_processor`` (SGLang's extension), checked and loaded now so
    a refusal is the request's 400. :raises BadRequest: see
    :meth:`~relax_hf.engine.Engine.load_processor`; not a string."""
    value = body.get("custom_logit_processor")
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(
            "custom_logit_processor", "must be the string CustomLogitProcessor.to_str() returns"
        )
    engine.load_processor(value)
    return value


async def _submit_stream(
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    logprob: LogprobParams,
    field: str,
    processor: str | None = None,
) -> tuple[list[str], asyncio.Queue[dict[str, Any]]]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    rids: list[str] = []
    try:
        for ids in prompts:
            subs = engine.submit(
                ids, sampling, logprob, stream=True, field=field, queue=queue, processor=processor
            )
            rids += [seq.rid for seq, _ in subs]
    except BaseException:
        for r in rids:
            engine.abort(r, "Abort: another prompt of the request was refused")
        raise
    return rids, queue


async def _deltas(
    engine: Engine, rids: list[str], queue: asyncio.Queue[dict[str, Any]]
) -> AsyncIterator[tuple[int, str, dict[str, Any], int]]:
    """``(choice index, text delta, snapshot, first new token)`` as the samples produce
    them: the delta covers the output tokens from ``first new token`` on."""
    index = {rid: i for i, rid in enumerate(rids)}
    sent = dict.fromkeys(rids, "")
    tokens = dict.fromkeys(rids, 0)
    open_ = set(rids)
    try:
        while open_:
            snap = await queue.get()
            rid = snap["meta_info"]["id"]
            finished = snap["meta_info"]["finish_reason"] is not None
            if finished:
                open_.discard(rid)
            text = snap["text"]
            # Hold back an incomplete UTF-8 character until the next token completes it.
            if not finished and text.endswith("\ufffd"):
                continue
            before = sent[rid]
            delta = text[len(before) :] if text.startswith(before) else text
            sent[rid] = text
            first, tokens[rid] = tokens[rid], len(snap["output_ids"])
            yield index[rid], delta, snap, first
    finally:
        for rid in open_:
            engine.abort(rid, "Abort: the client went away")


# -- chat -------------------------------------------------------------------------------------


def _chat_logprobs(meta: dict[str, Any], first: int = 0) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs`` of the output tokens from ``first`` on."""
    if "output_token_logprobs" not in meta:
        return None
    entries = meta["output_token_logprobs"]
    tops = meta.get("output_top_logprobs") or [None] * len(entries)
    content = []
    for (lp, _tid, text), top in zip(entries[first:], tops[first:], strict=True):
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


#: The fields of SGLang's ``Function`` (protocol.py) in its order; ``strict`` and
#: ``defer_loading`` are dropped when unset, the others written as ``null``.
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def _template_tool(tool: Any, field: str) -> dict[str, Any]:
    """One tool as SGLang's ``Tool.model_dump()`` gives it to the chat template: the client's
    function keys in the client's order (unknown keys dropped), ``description`` and
    ``parameters`` added as ``null`` when missing, and the tool's ``defer_loading``."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise BadRequest(field, "must be an object with a function object")
    function = tool["function"]
    if not isinstance(function.get("name"), str):
        raise BadRequest(f"{field}.function.name", "must be a string")
    defer = tool.get("defer_loading")
    if defer is not None and function.get("defer_loading") is None:
        function = {**function, "defer_loading": defer}
    dumped = {k: function.get(k) for k in _FUNCTION_FIELDS}
    for k in ("strict", "defer_loading"):
        if dumped[k] is None:
            del dumped[k]
    order = [k for k in function if k in dumped] + [k for k in dumped if k not in function]
    return {
        "type": tool.get("type", "function"),
        "function": {k: dumped[k] for k in order},
        "defer_loading": defer,
    }


def template_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The ``tools`` a chat request's template renders, as SGLang's chat server passes them:
    none with ``tool_choice: "none"``, only the named one with a named ``tool_choice``, else
    all. :raises BadRequest: naming a malformed tool."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools", "must be a list of tools")
    dumped = [_template_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if not dumped or choice == "none":
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return [t for t in dumped if t["function"]["name"] == name] or None
    return dumped


def chat_prompt_ids(
    engine: Engine, body: dict[str, Any], *, add_generation_prompt: bool = True
) -> list[int]:
    """The token ids of ``body["messages"]`` through the tokenizer's chat template (which
    writes its own special tokens), with the request's :func:`template_tools`.

    :raises BadRequest: naming the message or tool at fault."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            parts = [p.get("text") if isinstance(p, dict) else None for p in content]
            if not all(isinstance(p, str) for p in parts):
                raise BadRequest(f"messages[{i}].content", "only text parts are supported")
            m = {**m, "content": "".join(parts)}  # type: ignore[arg-type]
            messages[i] = m
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
    tools: list[Any] | None = template_tools(body)
    ids = tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    engine = engine_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    sampling = openai_sampling(engine, body, None)
    processor = openai_processor(engine, body)
    logprobs = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20
    ):
        raise BadRequest("top_logprobs", f"must be an integer in [0, 20], got {top!r}")
    if top and not logprobs:
        raise BadRequest("top_logprobs", "needs logprobs: true")
    logprob = LogprobParams(
        return_logprob=logprobs, top_logprobs_num=top or 0, return_text_in_logprobs=logprobs
    )
    stream = _flag(body, "stream")
    ids = chat_prompt_ids(engine, body)
    given = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if body.get(given) is not None:
        check_total_tokens(engine, len(ids), sampling.max_new_tokens, given)
    await engine.check_grammar(sampling, "response_format" if body.get("response_format") else "")
    model = engine.served_model_name
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if stream:
        usage = _stream_options(body, cached=_cache_report(request))
        rids, queue = await _submit_stream(engine, [ids], sampling, logprob, "", processor)
        return StreamingResponse(
            _chat_stream(
                engine, rids, queue, cid, created, model, sampling.n, usage=usage, logprobs=logprobs
            ),
            media_type="text/event-stream",
        )
    outs = await engine.generate(ids, sampling, logprob, processor=processor)
    choices = []
    for i, out in enumerate(outs):
        meta = out["meta_info"]
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": out["text"], "reasoning_content": None},
                "logprobs": _chat_logprobs(meta),
                "finish_reason": _finish(meta["finish_reason"]),
                "matched_stop": meta["finish_reason"].get("matched"),
            }
        )
    metas = [o["meta_info"] for o in outs]
    return AnswerResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(metas, sampling.n, cached=_cache_report(request)),
            "weight_version": metas[0]["weight_version"],
        }
    )


async def _chat_stream(
    engine: Engine,
    rids: list[str],
    queue: asyncio.Queue[dict[str, Any]],
    cid: str,
    created: int,
    model: str,
    n: int,
    *,
    usage: _StreamUsage,
    logprobs: bool,
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        return sse({**head, "choices": choices, **extra})

    def choice(index: int, delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
        # SGLang's StreamDelta always carries reasoning_content (null without a reasoning
        # parser): its clients read the key; role and content only when set.
        return {
            "index": index,
            "delta": {"reasoning_content": None, **delta},
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
            **fields,
        }

    metas: dict[int, dict[str, Any]] = {}
    opened: set[int] = set()
    async for index, delta, snap, first in _deltas(engine, rids, queue):
        meta = snap["meta_info"]
        if index not in opened:
            # SGLang's: a choice's role chunk comes with its first output (its prompt's
            # cached_tokens are known from then on).
            opened.add(index)
            role = {"role": "assistant", "content": ""}
            yield chunk([choice(index, role)], **usage.of_choice(meta, opening=True))
        finish = _finish(meta["finish_reason"])
        fresh = logprobs and len(snap["output_ids"]) > first
        if delta or fresh:
            lp = _chat_logprobs(meta, first) if fresh else None
            yield chunk([choice(index, {"content": delta}, logprobs=lp)], **usage.of_choice(meta))
        if finish is not None:
            metas[index] = meta
            matched = meta["finish_reason"].get("matched")
            last = choice(index, {}, finish_reason=finish, matched_stop=matched)
            yield chunk([last], **usage.of_choice(meta))
    if usage.final:  # OpenAI's and SGLang's: one last chunk with no choices
        whole = [metas[i] for i in range(len(rids))]
        yield chunk([], usage=_usage(whole, n, cached=usage.cached))
    yield SSE_DONE


def _stream_options(body: dict[str, Any], *, cached: bool) -> _StreamUsage:
    """The usage a stream carries (``stream_options``: ``include_usage``,
    ``continuous_usage_stats``; each false when left out). :raises BadRequest: naming the
    field."""
    options = body.get("stream_options")
    if options is None:
        return _StreamUsage(cached=cached)
    if not isinstance(options, dict):
        raise BadRequest("stream_options", "must be an object")
    flags = {}
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"stream_options.{key}", "must be true or false")
        flags[key] = bool(value)
    return _StreamUsage(
        final=flags["include_usage"], continuous=flags["continuous_usage_stats"], cached=cached
    )


# -- completions ------------------------------------------------------------------------------


def _completion_prompts(engine: Engine, body: dict[str, Any]) -> list[list[int]]:
    prompt = body.get("prompt")
    vocab = engine.runner.vocab_size

    def ids_of(value: Any, field: str) -> list[int] | None:
        if (
            isinstance(value, list)
            and value
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        ):
            if any(t < 0 or t >= vocab for t in value):
                raise BadRequest(field, f"token ids must be in [0, {vocab})")
            return list(value)
        return None

    if isinstance(prompt, str) and prompt:
        return [encode_prompt(engine, prompt, "prompt")]
    single = ids_of(prompt, "prompt")
    if single is not None:
        return [single]
    if isinstance(prompt, list) and prompt:
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str) and p:
                out.append(encode_prompt(engine, p, f"prompt[{i}]"))
                continue
            ids = ids_of(p, f"prompt[{i}]")
            if ids is None:
                raise BadRequest(
                    f"prompt[{i}]", "must be a non-empty string or a list of token ids"
                )
            out.append(ids)
        return out
    raise BadRequest(
        "prompt", "must be a non-empty string, a list of strings, or (lists of) token ids"
    )


def _completion_logprobs(
    meta: dict[str, Any], echo: bool, k: int, first: int | None = None
) -> dict[str, Any] | None:
    """OpenAI's completion ``logprobs``: the prompt's (when ``echo``), then the output's; with
    ``first`` (a stream's later chunks) only the output tokens from ``first`` on.
    ``text_offset`` counts from the start of the choice's text either way."""
    if "output_token_logprobs" not in meta:
        return None
    entries = (meta.get("input_token_logprobs") or []) if echo else []
    tops = (meta.get("input_top_logprobs") or [None] * len(entries)) if echo else []
    start = 0 if first is None else len(entries) + first
    entries = entries + meta["output_token_logprobs"]
    tops = list(tops) + list(
        meta.get("output_top_logprobs") or [None] * len(meta["output_token_logprobs"])
    )
    tokens = [t or "" for _v, _i, t in entries]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens[start:],
        "token_logprobs": [v for v, _i, _t in entries[start:]],
        "top_logprobs": [
            None if top is None else {(t or ""): v for v, _i, t in top} for top in tops[start:]
        ]
        if k
        else None,
        "text_offset": offsets[start:],
    }


def _echo_text(engine: Engine, body: dict[str, Any], prompts: list[list[int]], i: int) -> str:
    """What ``echo`` prepends (SGLang's rule): the prompt as sent when it was text, else its
    ids decoded without special tokens."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and isinstance(prompt[i] if prompt else None, str):
        return str(prompt[i])
    return str(engine.runner.tokenizer.decode(prompts[i], skip_special_tokens=True))


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    engine = engine_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    sampling = openai_sampling(engine, body, 16)  # OpenAI's default max_tokens for completions
    processor = openai_processor(engine, body)
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20
    ):
        raise BadRequest("logprobs", f"must be an integer in [0, 20], got {logprobs!r}")
    echo = _flag(body, "echo")
    stream = _flag(body, "stream")
    want = logprobs is not None
    logprob = LogprobParams(
        return_logprob=want,
        logprob_start_len=0 if echo else -1,
        top_logprobs_num=logprobs or 0,
        return_text_in_logprobs=want,
    )
    prompts = _completion_prompts(engine, body)
    for ids in prompts:  # max_tokens always counts here (its default, 16, is SGLang's too)
        check_total_tokens(engine, len(ids), sampling.max_new_tokens, "max_tokens")
    await engine.check_grammar(sampling, "response_format" if body.get("response_format") else "")
    model = engine.served_model_name
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if stream:
        usage = _stream_options(body, cached=_cache_report(request))
        echoes = (
            [_echo_text(engine, body, prompts, i) for i in range(len(prompts))] if echo else None
        )
        rids, queue = await _submit_stream(engine, prompts, sampling, logprob, "", processor)
        return StreamingResponse(
            _completion_stream(
                engine,
                rids,
                queue,
                cid,
                created,
                model,
                sampling.n,
                usage=usage,
                logprobs=logprobs,
                echoes=echoes,
            ),
            media_type="text/event-stream",
        )
    results = await asyncio.gather(
        *(engine.generate(ids, sampling, logprob, processor=processor) for ids in prompts)
    )
    outs = [o for res in results for o in res]
    choices = []
    for i, out in enumerate(outs):
        meta = out["meta_info"]
        text = out["text"]
        if echo:
            text = _echo_text(engine, body, prompts, i // sampling.n) + text
        choices.append(
            {
                "index": i,
                "text": text,
                "logprobs": _completion_logprobs(meta, echo, logprobs or 0),
                "finish_reason": _finish(meta["finish_reason"]),
                "matched_stop": meta["finish_reason"].get("matched"),
            }
        )
    metas = [o["meta_info"] for o in outs]
    return AnswerResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(metas, sampling.n, cached=_cache_report(request)),
            "weight_version": metas[0]["weight_version"],
        }
    )


async def _completion_stream(
    engine: Engine,
    rids: list[str],
    queue: asyncio.Queue[dict[str, Any]],
    cid: str,
    created: int,
    model: str,
    n: int,
    *,
    usage: _StreamUsage,
    logprobs: int | None,
    echoes: list[str] | None,
) -> AsyncIterator[bytes]:
    """``echoes``: with ``echo``, the text each prompt's choices open with (SGLang's stream:
    the prompt leads a choice's first chunk, its log-probs lead that chunk's)."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        head = {"id": cid, "object": "text_completion", "created": created, "model": model}
        return sse({**head, "choices": choices, **extra})

    echo = echoes is not None
    metas: dict[int, dict[str, Any]] = {}
    opened: set[int] = set()
    async for index, delta, snap, first in _deltas(engine, rids, queue):
        meta = snap["meta_info"]
        opening = index not in opened
        opened.add(index)
        if opening and echoes is not None:
            delta = echoes[index // n] + delta
        finish = _finish(meta["finish_reason"])
        fresh = logprobs is not None and (len(snap["output_ids"]) > first or (opening and echo))
        if delta or fresh or finish is not None:
            since = None if opening else first
            lp = _completion_logprobs(meta, echo, logprobs or 0, since) if fresh else None
            choice: dict[str, Any] = {
                "index": index,
                "text": delta,
                "logprobs": lp,
                "finish_reason": finish,
            }
            if finish is not None:
                metas[index] = meta
                choice["matched_stop"] = meta["finish_reason"].get("matched")
            yield chunk([choice], **usage.of_choice(meta))
    if usage.final:  # OpenAI's and SGLang's: one last chunk with no choices
        whole = [metas[i] for i in range(len(rids))]
        yield chunk([], usage=_usage(whole, n, cached=usage.cached))
    yield SSE_DONE
