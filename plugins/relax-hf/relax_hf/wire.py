"""What the engine's two HTTP faces share (SGLang's native routes in :mod:`relax_hf.server`, the
OpenAI-compatible ones in :mod:`relax_hf.openai_api`): SGLang's error shape and the guard that
maps the engine's errors onto it, reading a JSON body, the engine behind a request, encoding a
prompt, and SSE framing.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from relax_hf.engine import Conflict, Engine, NotResident, Unavailable
from relax_hf.nodes import NodeLost
from relax_hf.protocol import (
    SAMPLING_MASK_MAX_TOKENS,
    BadRequest,
    LogprobParams,
    NotFound,
    SamplingParams,
)
from relax_hf.runner import WeightsError

__all__ = [
    "SSE_DONE",
    "AnswerResponse",
    "Handler",
    "check_sampling_mask",
    "check_total_tokens",
    "encode_prompt",
    "engine_of",
    "error_response",
    "guard",
    "not_resident",
    "read_json",
    "sse",
]


#: The error ``type`` by status, as SGLang's OpenAI server names them.
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_response(
    status: int,
    message: str,
    *,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    error_type: str | None = None,
    code: int | str | None = None,
) -> JSONResponse:
    """SGLang's error shapes in one body: its OpenAI routes' top-level ``ErrorResponse``
    (``object: "error"``, ``message``, ``type``, ``param``, ``code``), the nested ``error``
    object of ``/generate`` and ``/v1/responses`` (the ``openai`` client reads that one), and
    ``success: false`` for control clients. ``field`` (the offending field) is the ``param``."""
    kind = error_type or _ERROR_TYPES.get(status, "Error")
    error: dict[str, Any] = {
        "message": message,
        "type": kind,
        "param": field,
        "code": status if code is None else code,
    }
    if field:
        error["field"] = field
    body: dict[str, Any] = {
        "object": "error",
        "message": message,
        "type": kind,
        "param": field,
        "code": status,
        "error": error,
        "success": False,
    }
    return JSONResponse(body, status_code=status, headers=headers)


async def read_json(request: Request, *, optional: bool = False) -> Any:
    """The parsed JSON body. :raises BadRequest: malformed JSON (or a missing required body)."""
    raw = await request.body()
    if not raw.strip():
        if optional:
            return None
        raise BadRequest("body", "a JSON object is required")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequest("body", f"malformed JSON: {exc}") from exc


def not_resident(exc: Exception) -> JSONResponse:
    return error_response(503, str(exc), headers={"Retry-After": "1"})


Handler = Callable[[Request], Awaitable[Response]]


def guard(fn: Handler) -> Handler:
    """Map the engine's errors to HTTP answers (never a 500 for the caller's mistake)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except BadRequest as exc:
            return error_response(400, str(exc), field=exc.field)
        except NotFound as exc:
            return error_response(
                404, exc.message, field=exc.param, error_type="invalid_request_error", code=exc.code
            )
        except (WeightsError, Conflict) as exc:
            return error_response(400, str(exc))
        except NotResident as exc:
            return not_resident(exc)
        except (Unavailable, NodeLost) as exc:
            return error_response(503, str(exc))

    return wrapped


def engine_of(request: Request) -> Engine:
    """The engine serving ``request`` (the app's state)."""
    return request.app.state.engine  # type: ignore[no-any-return]


def encode_prompt(engine: Engine, prompt: str | tuple[int, ...], field: str = "text") -> list[int]:
    """Token ids of a prompt, by SGLang's rule for text: the tokenizer's own encoding, with the
    special tokens it adds (a Llama-3 tokenizer's BOS), so the model sees what SGLang gives
    it. Token ids are taken as they are. (Chat prompts come from the chat template, which
    writes its own special tokens: see :mod:`relax_hf.openai_api`.)"""
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(field, "must not be empty")
        return list(engine.runner.tokenizer(prompt)["input_ids"])
    return list(prompt)


def check_total_tokens(
    engine: Engine, input_tokens: int, max_new_tokens: int | None, field: str = "max_new_tokens"
) -> None:
    """SGLang's check of an explicit ``max_new_tokens`` (``max_tokens``): the prompt and it
    must fit the context. :raises BadRequest: with SGLang's message, naming ``field``."""
    context = engine.runner.max_len
    if max_new_tokens is not None and input_tokens + max_new_tokens > context:
        raise BadRequest(
            field,
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {input_tokens + max_new_tokens} tokens: "
            f"{input_tokens} tokens from the input messages and {max_new_tokens} tokens for "
            "the completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.",
        )


def check_sampling_mask(sampling: SamplingParams, logprob: LogprobParams, field: str) -> None:
    """SGLang's bound on ``return_sampling_mask``: greedy, or a finite ``top_k`` of at most
    :data:`~relax_hf.protocol.SAMPLING_MASK_MAX_TOKENS`. :raises BadRequest: otherwise."""
    if not logprob.return_sampling_mask or sampling.greedy:
        return
    cap = SAMPLING_MASK_MAX_TOKENS
    if not 1 < sampling.top_k <= cap:
        raise BadRequest(
            f"{field}.top_k" if field else "top_k",
            f"return_sampling_mask requires top_k=1 for greedy sampling or finite "
            f"1 < top_k <= {cap}; got top_k={sampling.top_k}. Lower top_k or increase "
            "--sampling-mask-max-tokens.",
        )


class AnswerResponse(JSONResponse):
    """A generation's JSON answer, encoded with orjson as SGLang's (``ORJSONResponse``): a
    group of 8 samples with their tokens' log-probs takes ~2.5 ms with the json module, held
    on the event loop against the compute thread, ~0.04 ms so. A float that is not finite
    is written ``null``."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def sse(obj: Any) -> bytes:
    """One SSE event as SGLang writes it."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
