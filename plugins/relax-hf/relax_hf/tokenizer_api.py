"""SGLang's tokenizer routes: ``/tokenize`` and ``/detokenize`` (also under ``/v1``).

``/tokenize`` takes ``prompt`` (a string or a list of strings, encoded with the tokenizer's
special tokens unless ``add_special_tokens`` is false: the ids ``/generate`` would run) or
``messages`` (through the chat template, as a chat completion builds its prompt) and answers
``{tokens, count, max_model_len}``; ``/detokenize`` takes ``tokens`` (a list of ids or a list of
lists) and answers ``{text}`` (``skip_special_tokens``, default true). Shapes and defaults are
SGLang's ``TokenizeRequest`` / ``DetokenizeRequest``.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from relax_hf.engine import Engine
from relax_hf.openai_api import chat_prompt_ids
from relax_hf.protocol import BadRequest
from relax_hf.wire import engine_of, read_json

__all__ = ["detokenize", "tokenize"]


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(key, f"must be true or false, got {value!r}")
    return value


def _max_model_len(engine: Engine) -> int:
    # SGLang's: the tokenizer's model_max_length when it is a real number, else the context.
    limit = getattr(engine.runner.tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 2**63:
        return limit
    return engine.runner.max_len


async def tokenize(request: Request) -> Response:
    """``POST /tokenize`` and ``/v1/tokenize``."""
    engine = engine_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    tok = engine.runner.tokenizer
    special = _flag(body, "add_special_tokens", True)
    prompt = body.get("prompt")
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    if body.get("messages") is not None:
        if prompt is not None:
            raise BadRequest("prompt", "give either prompt or messages, not both")
        generation = _flag(body, "add_generation_prompt", True)
        ids = chat_prompt_ids(engine, body, add_generation_prompt=generation)
        tokens, count = ids, len(ids)
    elif isinstance(prompt, str):
        ids = list(tok(prompt, add_special_tokens=special)["input_ids"])
        tokens, count = ids, len(ids)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        many = [list(tok(p, add_special_tokens=special)["input_ids"]) for p in prompt]
        tokens, count = many, [len(ids) for ids in many]
    else:
        raise BadRequest("prompt", "must be a string or a list of strings (or give messages)")
    return JSONResponse({"tokens": tokens, "count": count, "max_model_len": _max_model_len(engine)})


def _ids(value: Any, field: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise BadRequest(field, "must be a list of integers")
    bad = next((t for t in value if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(field, f"token id {bad} is out of vocabulary (vocab size: {vocab})")
    return value


async def detokenize(request: Request) -> Response:
    """``POST /detokenize`` and ``/v1/detokenize``."""
    engine = engine_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    tokens = body.get("tokens")
    skip = _flag(body, "skip_special_tokens", True)
    decode = engine.batch.decode
    vocab = engine.runner.vocab_size
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        texts = [decode(_ids(t, f"tokens[{i}]", vocab), skip) for i, t in enumerate(tokens)]
        return JSONResponse({"text": texts})
    if not isinstance(tokens, list):
        raise BadRequest("tokens", "must be a list of token ids or a list of such lists")
    return JSONResponse({"text": decode(_ids(tokens, "tokens", vocab), skip) if tokens else ""})
