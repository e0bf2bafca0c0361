"""The OpenAPI 3.1 document of a role gateway (``docs/openapi/{role}.json`` is generated from it).

``python -m relax_core.gateway.openapi docs/openapi`` writes one document per role; a test checks
that the committed documents match this generator and that every route of the app is in its
document (and nothing else is).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["ROLES", "openapi_document", "write_documents"]

#: The roles whose documents are committed under ``docs/openapi/``.
ROLES = ("rollout", "genrm", "teacher")

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
}

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": _INT_MAX}
_INPUT_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of an object schema whose optional properties also accept null.

    The gateway (like SGLang, whose request fields are optional) takes a null optional field as
    absent; the documents say so, so a client that always sends every key stays valid.
    """
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


def _generate_request(role: str) -> dict[str, Any]:
    common = {
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
    if role == "rollout":  # rollout also sends batches: a list of prompts
        inputs[0]["properties"]["text"] = {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            ]
        }
        inputs[1]["properties"]["input_ids"] = {
            "oneOf": [_INPUT_IDS, {"type": "array", "minItems": 1, "items": _INPUT_IDS}]
        }
    if role == "genrm":
        inputs.append(
            {
                "required": ["messages"],
                "properties": {
                    "messages": _MESSAGES,
                    "stream": {"const": False, "description": "messages cannot be streamed"},
                },
            }
        )
    if role == "teacher":
        common["token_ids_logprob"] = {"type": "array", "items": _TOKEN_ID}
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


def _responses(ok: dict[str, Any], *codes: int) -> dict[str, Any]:
    texts = {
        400: "Bad JSON, bad payload, unknown model or route key.",
        401: "Missing or wrong bearer token (gateways started with a token).",
        413: "Request body over the gateway's limit.",
        502: "The engine could not be reached, failed mid-exchange, or answered badly.",
        503: "Model not READY, nothing routable, or registry unavailable (see Retry-After).",
        504: "The request deadline passed (it is not replayed).",
    }
    out: dict[str, Any] = {"200": ok}
    for code in codes:
        entry: dict[str, Any] = {
            "description": texts[code],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        if code == 503:
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
        out[str(code)] = entry
    return out


_FORWARD_ERRORS = (400, 401, 413, 502, 503, 504)


def _generate_ok(role: str) -> dict[str, Any]:
    if role == "genrm":
        schema: dict[str, Any] = {
            "description": "{response: text} for messages; the engine's answer for raw input.",
            "type": "object",
        }
    else:
        schema = {
            "description": "The engine's SGLang /generate answer.",
            "type": ["object", "array"],
        }
    return {
        "description": "The engine's answer (an SSE stream with stream: true).",
        "content": {
            "application/json": {"schema": schema},
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    }


_CHAT_OK = {
    "description": "An OpenAI chat completion (an SSE stream of chunks with stream: true).",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {"schema": _SSE_EVENT},
    },
}


def _schema_param() -> dict[str, Any]:
    return {
        "name": "schema",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "enum": [1, 2]},
    }


def openapi_document(role: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``role``'s gateway."""
    p = f"/{role}"
    health_default = 1 if role == "genrm" else 2
    json_ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    chat_op = {
        "summary": "OpenAI chat completions, forwarded to the selected model",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}
            },
        },
        "responses": _responses(_CHAT_OK, *_FORWARD_ERRORS),
    }
    paths: dict[str, Any] = {
        f"{p}/generate": {
            "post": {
                "summary": f"Raw SGLang generation for the {role} role"
                + (" (or the messages judge protocol)" if role == "genrm" else ""),
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/GenerateRequest"}
                        }
                    },
                },
                "responses": _responses(_generate_ok(role), *_FORWARD_ERRORS),
            }
        },
        f"{p}/chat/completions": {"post": {**chat_op, "summary": "Alias of v1/chat/completions"}},
        f"{p}/v1/chat/completions": {"post": chat_op},
        f"{p}/v1/models": {
            "get": {
                "summary": "The role's logical models",
                "responses": _responses(json_ok, 401, 503),
            }
        },
        f"{p}/engines": {
            "get": {
                "summary": "Discovery: the schema-2 snapshot (default) or the schema-1 view",
                "parameters": [_schema_param()],
                "responses": _responses(json_ok, 400, 401, 503),
            }
        },
        f"{p}/health": {
            "get": {
                "summary": f"Readiness (default schema {health_default}); 503 when not ready",
                "parameters": [_schema_param()],
                "responses": _responses(json_ok, 400, 503),
            }
        },
        f"{p}/openapi.json": {"get": {"summary": "This document", "responses": {"200": json_ok}}},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"Relax {role} gateway",
            "version": "1",
            "description": (
                f"The {role} role gateway: validates, selects the model through the role's "
                "schema-2 snapshot and forwards to a router or a READY replica head. Errors are "
                "JSON {error: {message, type, code}}."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": {
                "Error": _ERROR,
                "GenerateRequest": _generate_request(role),
                "ChatRequest": _CHAT_REQUEST,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def write_documents(directory: Path) -> list[Path]:
    """Write ``{role}.json`` for every role of :data:`ROLES` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for role in ROLES:
        path = directory / f"{role}.json"
        path.write_text(json.dumps(openapi_document(role), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_documents(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/openapi")):
        print(written_path)
