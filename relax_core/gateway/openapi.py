"""The OpenAPI 3.1 document of a role gateway (``docs/openapi/{role}.json`` is generated from it).

Every role gateway serves the same routes; what a role adds to its ``/generate`` and its default
health schema come from its :class:`~relax_core.records.RoleSpec` (``openapi``,
``health_schema``). ``python -m relax_core.gateway.openapi DIR [ROLE ...]`` writes
``DIR/{role}.json`` for each ``ROLE`` (without ``ROLE``: the documents already in ``DIR``)."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from relax_core.records import OpenAPINotes, RoleSpec

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string", "description": "What was wrong and what to do."},
                "type": {"type": "string"},
                "code": {"type": "integer"},
                "param": {"type": "string", "description": "The offending field, if any."},
            },
        }
    },
}

_INT_MAX = 2**31 - 1
_COUNT = {"type": "integer", "minimum": 0, "maximum": _INT_MAX}

_SAMPLING = {
    # null means the engine's defaults, as in SGLang.
    "type": ["object", "null"],
    "description": "SGLang sampling parameters (null: the engine's defaults); unknown keys are "
    "forwarded to the engine.",
    "properties": {
        "max_new_tokens": _COUNT,
        "min_new_tokens": _COUNT,
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": _INT_MAX},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "skip_special_tokens": {"type": "boolean"},
    },
}

_SSE_EVENT = {
    "description": "One server-sent event as relayed from the engine; data is JSON or [DONE].",
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}

# null is taken as absent (as the gateway does), so clients that always send the keys work.
_ROUTING_FIELDS = {
    "model": {
        "type": ["string", "null"],
        "description": "Logical model id or alias (absent or null: the role's default).",
    },
    "route_key": {
        "type": ["string", "null"],
        "description": "Picks the model through the route-key map (absent or null: none).",
    },
    "min_weight_version": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "integer", "minimum": 0},
            {"type": "null"},
        ],
        "description": "Serve only with weights of at least this version (digit runs compare "
        "as numbers); until a replica has it: 503 + Retry-After, nothing sent. Not forwarded "
        "to the engine. Same as the X-Relax-Min-Weight-Version header.",
    },
}

_MIN_VERSION_HEADER = {
    "name": "X-Relax-Min-Weight-Version",
    "in": "header",
    "required": False,
    "description": "Serve only with weights of at least this version (as the body field "
    "min_weight_version, which wins when both are given).",
    "schema": {"type": "string", "minLength": 1},
}

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": _INT_MAX}
_INPUT_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of an object schema whose optional properties also accept null (the gateway, as
    SGLang, takes a null optional field as absent)."""
    out = dict(schema)
    required = set(schema.get("required", ()))
    props: dict[str, Any] = {}
    for name, prop in schema.get("properties", {}).items():
        prop = dict(prop)
        if prop.get("type") == "object" or prop.get("type") == ["object", "null"]:
            prop = _nullable(prop)
        if name not in required and "const" not in prop:
            kind = prop.get("type")
            if isinstance(kind, str):
                prop["type"] = [kind, "null"]
            elif isinstance(kind, list) and "null" not in kind:
                prop["type"] = [*kind, "null"]
            elif "oneOf" in prop and {"type": "null"} not in prop["oneOf"]:
                prop["oneOf"] = [*prop["oneOf"], {"type": "null"}]
        props[name] = prop
    if props:
        out["properties"] = props
    return out


def _generate_request(notes: OpenAPINotes) -> dict[str, Any]:
    common: dict[str, Any] = {
        **_ROUTING_FIELDS,
        "sampling_params": _SAMPLING,
        "stream": {"type": "boolean", "description": "Relay the engine's SSE stream."},
        "return_logprob": {"type": "boolean"},
        "logprob_start_len": {"type": "integer", "minimum": -1, "maximum": _INT_MAX},
        "top_logprobs_num": _COUNT,
        "rid": {"type": "string"},
    }
    inputs: list[dict[str, Any]] = [
        {"required": ["text"], "properties": {"text": {"type": "string", "minLength": 1}}},
        {"required": ["input_ids"], "properties": {"input_ids": _INPUT_IDS}},
    ]
    if notes.batched_generate:  # a batch: a list of prompts
        inputs[0]["properties"]["text"] = {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            ]
        }
        inputs[1]["properties"]["input_ids"] = {
            "oneOf": [_INPUT_IDS, {"type": "array", "minItems": 1, "items": _INPUT_IDS}]
        }
    taken = {name for branch in inputs for name in branch["required"]}
    for name in notes.input_names:
        if name in taken or name in common:
            raise ValueError(
                f"OpenAPINotes.generate_inputs: {name!r} is already a common /generate field"
            )
    inputs += copy.deepcopy(list(notes.generate_inputs))
    for name, schema in notes.generate_fields.items():
        if name in common or name in taken:
            raise ValueError(
                f"OpenAPINotes.generate_fields: {name!r} is already a common /generate field; "
                "list only the fields the role adds"
            )
        common[name] = copy.deepcopy(schema)
    return _nullable({"type": "object", "properties": common, "oneOf": inputs})


_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "minLength": 1, "description": "system, user, assistant"},
            "content": {"type": ["string", "array", "null"]},
        },
    },
}

_CHAT_REQUEST = _nullable(
    {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **_ROUTING_FIELDS,
            "messages": _MESSAGES,
            "stream": {"type": "boolean"},
            "max_tokens": _COUNT,
            "max_completion_tokens": _COUNT,
            "n": _COUNT,
            "temperature": {"type": "number", "minimum": 0},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        },
    }
)


_ERROR_TEXTS = {
    400: "Bad JSON, bad payload, unknown model or route key.",
    401: "Missing or wrong bearer token (gateways started with a token).",
    413: "Request body over the gateway's limit.",
    502: "The engine could not be reached, failed mid-exchange, or answered badly.",
    503: "Model not READY, nothing routable, or registry unavailable (see Retry-After).",
    504: "The request deadline passed (it is not replayed).",
}
_FORWARD_ERRORS = (400, 401, 413, 502, 503, 504)
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}}}
_JSON_OK = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
_TEXT_OK = {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
_SCHEMA_PARAM = {
    "name": "schema",
    "in": "query",
    "required": False,
    "schema": {"type": "integer", "enum": [1, 2]},
}
_SGLANG_ANSWER = {
    "description": "The engine's SGLang /generate answer.",
    "type": ["object", "array"],
}
_CHAT_OK = {
    "description": "An OpenAI chat completion (an SSE stream of chunks with stream: true).",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {"schema": _SSE_EVENT},
    },
}


def _op(
    summary: str,
    ok: dict[str, Any],
    codes: tuple[int, ...] = (),
    params: tuple[dict[str, Any], ...] = (),
    body: str | None = None,
) -> dict[str, Any]:
    """One operation: its summary, parameters, JSON request body schema name and responses."""
    op: dict[str, Any] = {"summary": summary}
    if params:
        op["parameters"] = list(params)
    if body is not None:
        schema = {"$ref": f"#/components/schemas/{body}"}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    responses: dict[str, Any] = {"200": ok}
    for code in codes:
        entry = {"description": _ERROR_TEXTS[code], "content": _ERROR_CONTENT}
        responses[str(code)] = {**entry, "headers": _RETRY_AFTER} if code == 503 else entry
    op["responses"] = responses
    return op


def openapi_document(role: RoleSpec | str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a role's gateway.

    :param role: the role's record (its ``openapi`` notes and ``health_schema`` shape the
        document), or a bare role name for a role without a record: the common document,
        health schema 2.
    :raises ValueError: the role's notes redefine a common ``/generate`` field."""
    spec = role if isinstance(role, RoleSpec) else None
    notes = spec.openapi if spec is not None else OpenAPINotes()
    name = spec.name if spec is not None else str(role)
    p = f"/{name}"
    health_default = spec.health_schema if spec is not None else 2
    version = (_MIN_VERSION_HEADER,)
    chat = _op(
        "OpenAI chat completions, forwarded to the selected model",
        _CHAT_OK,
        _FORWARD_ERRORS,
        version,
        "ChatRequest",
    )
    generate = f"Raw SGLang generation for the {name} role" + notes.generate_summary
    answer = _SGLANG_ANSWER if notes.generate_answer is None else notes.generate_answer
    generate_ok = {
        "description": "The engine's answer (an SSE stream with stream: true).",
        "content": {
            "application/json": {"schema": copy.deepcopy(answer)},
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    }
    paths: dict[str, Any] = {
        f"{p}/generate": {
            "post": _op(generate, generate_ok, _FORWARD_ERRORS, version, "GenerateRequest")
        },
        f"{p}/chat/completions": {"post": {**chat, "summary": "Alias of v1/chat/completions"}},
        f"{p}/v1/chat/completions": {"post": chat},
        f"{p}/v1/models": {"get": _op("The role's logical models", _JSON_OK, (401, 503))},
        f"{p}/engines": {
            "get": _op(
                "Discovery: the schema-2 snapshot (default) or the schema-1 view",
                _JSON_OK,
                (400, 401, 503),
                (_SCHEMA_PARAM,),
            )
        },
        f"{p}/health": {
            "get": _op(
                f"Readiness (default schema {health_default}); 503 when not ready",
                _JSON_OK,
                (400, 503),
                (_SCHEMA_PARAM,),
            )
        },
        f"{p}/openapi.json": {"get": _op("This document", _JSON_OK)},
        "/metrics": {"get": _op("Prometheus metrics", _TEXT_OK)},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"Relax {name} gateway",
            "version": "1",
            "description": (
                f"The {name} role gateway: validates, selects the model through the role's "
                "schema-2 snapshot and forwards to a router or a READY replica head. Errors are "
                "JSON {error: {message, type, code}}."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": {
                "Error": _ERROR,
                "GenerateRequest": _generate_request(notes),
                "ChatRequest": _CHAT_REQUEST,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def write_documents(directory: Path, roles: Iterable[RoleSpec]) -> list[Path]:
    """Write ``{role}.json`` for every role of ``roles`` into ``directory``; return the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in roles:
        path = directory / f"{spec.name}.json"
        path.write_text(json.dumps(openapi_document(spec), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    """``python -m relax_core.gateway.openapi DIR [ROLE ...]`` (see the module docstring)."""
    from relax_core.errors import PluginError
    from relax_core.plugins import PluginManager

    if not argv or argv[0].startswith("-"):
        print("usage: python -m relax_core.gateway.openapi DIR [ROLE ...]", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    names = argv[1:] or sorted(p.stem for p in directory.glob("*.json"))
    if not names:
        print(
            f"{directory} holds no {{role}}.json to regenerate; name the roles to write",
            file=sys.stderr,
        )
        return 2
    pm = PluginManager.create()
    try:
        specs = [pm.role(name) for name in names]
    except PluginError as exc:
        print(f"relax openapi: {exc}", file=sys.stderr)
        return 2
    for path in write_documents(directory, specs):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
