"""Constrained decoding with xgrammar: regex, JSON schema, EBNF, OpenAI response_format."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from relax_hf.testing import EngineServer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(shared_server: EngineServer) -> EngineServer:
    # The shared engine bounds free whitespace in JSON output (see conftest.py).
    return shared_server


def parse(text: str) -> Any:
    # xgrammar's JSON strings admit raw control characters (so SGLang's do): parse leniently.
    return json.loads(text, strict=False)


def gen(server: EngineServer, **sp: Any) -> dict[str, Any]:
    body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 96, **sp}}
    return server.http.ok("/generate", body)  # type: ignore[no-any-return]


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_a_regex_constrains_the_output(server: EngineServer, seed: int | None) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    sp: dict[str, Any] = {"regex": pattern}
    sp.update({"temperature": 0.0} if seed is None else {"sampling_seed": seed})
    out = gen(server, **sp)
    assert re.fullmatch(pattern, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("seed", [None, 7])
def test_a_json_schema_constrains_the_output(server: EngineServer, seed: int | None) -> None:
    sp: dict[str, Any] = {"json_schema": json.dumps(SCHEMA)}
    sp.update({"temperature": 0.0} if seed is None else {"sampling_seed": seed})
    out = gen(server, **sp)
    value = parse(out["text"])
    assert set(value) == {"name", "ok", "n"}
    assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99 and len(value["name"]) <= 6


def test_an_ebnf_grammar_constrains_the_output(server: EngineServer) -> None:
    grammar = 'root ::= ("yes" | "no") " because " [a-z]{1,5}'
    out = gen(server, ebnf=grammar, sampling_seed=3)
    assert re.fullmatch(r"(yes|no) because [a-z]{1,5}", out["text"]), out["text"]


def test_n_constrained_samples_each_match(server: EngineServer) -> None:
    body = {
        "text": "Code:",
        "sampling_params": {"max_new_tokens": 32, "regex": "[A-Z]{2}[0-9]{2}", "n": 3},
    }
    out = server.http.ok("/generate", body)
    assert len(out) == 3
    assert all(re.fullmatch("[A-Z]{2}[0-9]{2}", o["text"]) for o in out)


def test_openai_response_format_json_schema_parses(server: EngineServer) -> None:
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": "Give me a record"}],
        "max_tokens": 96,
        "seed": 5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": SCHEMA},
        },
    }
    out = server.http.ok("/v1/chat/completions", body)
    value = parse(out["choices"][0]["message"]["content"])
    assert set(value) == {"name", "ok", "n"}


def test_openai_json_object_response_format_is_an_object(server: EngineServer) -> None:
    body = {
        "prompt": "{",
        "max_tokens": 96,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    out = server.http.ok("/v1/completions", body)
    choice = out["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(parse(choice["text"]), dict)
    else:  # an object that is still open when max_tokens runs out
        assert choice["text"].lstrip().startswith("{")
