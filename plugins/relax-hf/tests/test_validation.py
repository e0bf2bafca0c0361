"""Bad input answers 400 with a message naming the field, never a 500."""

from __future__ import annotations

from typing import Any

import pytest
from relax_hf.testing import EngineServer

OK = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}

CASES: list[tuple[str, str, Any, str]] = [
    ("/generate", "both text and input_ids", {"text": "a", "input_ids": [1, 2]}, "text"),
    ("/generate", "neither text nor input_ids", {"sampling_params": {}}, "text"),
    (
        "/generate",
        "negative max_new_tokens",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        "max_new_tokens",
    ),
    (
        "/generate",
        "string max_new_tokens",
        {"text": "a", "sampling_params": {"max_new_tokens": "5"}},
        "max_new_tokens",
    ),
    ("/generate", "top_p of zero", {"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    (
        "/generate",
        "negative temperature",
        {"text": "a", "sampling_params": {"temperature": -1}},
        "temperature",
    ),
    ("/generate", "top_k of zero", {"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    (
        "/generate",
        "unknown sampling parameter",
        {"text": "a", "sampling_params": {"tempurature": 1}},
        "tempurature",
    ),
    (
        "/generate",
        "token_ids_logprob with an id outside the vocabulary",
        {"text": "a", "return_logprob": True, "token_ids_logprob": [1, 10**9]},
        "token_ids_logprob",
    ),
    (
        "/generate",
        "a batch repeating a request id",
        {"text": ["a", "b"], "rid": ["x", "x"]},
        "rid",
    ),
    ("/generate", "token id outside the vocabulary", {"input_ids": [1, 10**9]}, "input_ids[1]"),
    ("/generate", "negative token id", {"input_ids": [-3]}, "input_ids[0]"),
    ("/generate", "empty input_ids", {"input_ids": []}, "input_ids"),
    (
        "/generate",
        "logprob_start_len past the prompt",
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
        "logprob_start_len",
    ),
    ("/generate", "stream that is not a boolean", {"text": "a", "stream": "yes"}, "stream"),
    (
        "/generate",
        "sampling_params that is a list",
        {"text": "a", "sampling_params": [1]},
        "sampling_params",
    ),
    ("/generate", "stop that is a number", {"text": "a", "sampling_params": {"stop": 3}}, "stop"),
    (
        "/generate",
        "penalty out of SGLang's range",
        {"text": "a", "sampling_params": {"frequency_penalty": 2.5}},
        "frequency_penalty",
    ),
    (
        "/generate",
        "repetition penalty of zero",
        {"text": "a", "sampling_params": {"repetition_penalty": 0}},
        "repetition_penalty",
    ),
    (
        "/generate",
        "seed instead of SGLang's sampling_seed",
        {"text": "a", "sampling_params": {"seed": 3}},
        "sampling_params.seed",
    ),
    (
        "/generate",
        "sampling_seed that is not an integer",
        {"text": "a", "sampling_params": {"sampling_seed": "x"}},
        "sampling_seed",
    ),
    (
        "/generate",
        "an SGLang-internal field",
        {"text": "a", "sampling_params": {"stop_strs": ["x"]}},
        "stop_strs",
    ),
    ("/generate", "n of zero", {"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
    (
        "/generate",
        "n above the running-request limit",
        {"text": "a", "sampling_params": {"n": 1000}},
        "sampling_params.n",
    ),
    (
        "/generate",
        "a regex that does not compile",
        {"text": "a", "sampling_params": {"regex": "([a-"}},
        "sampling_params.regex",
    ),
    (
        "/generate",
        "a json_schema that is not JSON",
        {"text": "a", "sampling_params": {"json_schema": "{nope"}},
        "sampling_params.json_schema",
    ),
    (
        "/generate",
        "a json_schema xgrammar cannot compile",
        {"text": "a", "sampling_params": {"json_schema": '{"type": "no-such-type"}'}},
        "sampling_params.json_schema",
    ),
    (
        "/generate",
        "an ebnf grammar with an undefined rule",
        {"text": "a", "sampling_params": {"ebnf": "root ::= missing"}},
        "sampling_params.ebnf",
    ),
    (
        "/generate",
        "two grammars at once",
        {"text": "a", "sampling_params": {"regex": "a+", "ebnf": 'root ::= "a"'}},
        "ebnf",
    ),
    (
        "/generate",
        "a stop_regex that does not compile",
        {"text": "a", "sampling_params": {"stop_regex": ["ok", "(x"]}},
        "sampling_params.stop_regex[1]",
    ),
    (
        "/generate",
        "logit_bias for a token outside the vocabulary",
        {"text": "a", "sampling_params": {"logit_bias": {"999999": 1.0}}},
        "logit_bias",
    ),
    (
        "/generate",
        "beam search",
        {"text": "a", "sampling_params": {"beam_width": 4}},
        "beam_width",
    ),
    (
        "/generate",
        "watermarking without a server key",
        {"text": "a", "sampling_params": {"watermark": {"enabled": True}}},
        "watermark",
    ),
    (
        "/generate",
        "a batch whose sampling_params list has the wrong length",
        {"text": ["a", "b"], "sampling_params": [{}]},
        "sampling_params",
    ),
    (
        "/generate",
        "a batch whose prompts ask for different n",
        {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]},
        "sampling_params",
    ),
    (
        "/generate",
        "a custom logit processor",
        {"text": "a", "custom_logit_processor": "gASV"},
        "--enable-custom-logit-processor",
    ),
    (
        "/v1/chat/completions",
        "a custom logit processor on chat",
        {"messages": [{"role": "user", "content": "x"}], "custom_logit_processor": "{}"},
        "--enable-custom-logit-processor",
    ),
    (
        "/v1/completions",
        "a custom logit processor on completions",
        {"prompt": "x", "custom_logit_processor": "{}", "custom_params": {"a": 1}},
        "--enable-custom-logit-processor",
    ),
    ("/generate", "a body that is a list", [1, 2], "body"),
    ("/release_memory_occupation", "unknown memory tag", {"tags": ["weights", "gpu"]}, "tags"),
    ("/resume_memory_occupation", "tags that is a string", {"tags": "weights"}, "tags"),
    ("/abort_request", "abort without rid", {}, "rid"),
    (
        "/update_weights_from_tensor",
        "payload that is not base64",
        {"serialized_named_tensors": ["***"], "load_format": "safetensors"},
        "serialized_named_tensors",
    ),
    (
        "/update_weights_from_tensor",
        "unknown load format",
        {"serialized_named_tensors": ["AA=="], "load_format": "gguf"},
        "load_format",
    ),
    ("/update_weights_from_disk", "missing model path", {}, "model_path"),
    (
        "/update_weights_from_disk",
        "model path that is no directory",
        {"model_path": "/nonexistent/dir"},
        "model_path",
    ),
    (
        "/update_weights_from_distributed",
        "without a group",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
        "group_name",
    ),
    (
        "/update_weights_from_distributed",
        "unknown dtype",
        {"names": ["x"], "dtypes": ["float99"], "shapes": [[1]]},
        "dtypes[0]",
    ),
    (
        "/init_weights_update_group",
        "missing master_port",
        {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2},
        "master_port",
    ),
    ("/pause_generation", "unknown pause mode", {"mode": "sleep"}, "mode"),
    ("/v1/chat/completions", "no messages", {"model": "tiny"}, "messages"),
    (
        "/v1/chat/completions",
        "a message without content",
        {"messages": [{"role": "user"}]},
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        "n of zero",
        {"messages": [{"role": "user", "content": "x"}], "n": 0},
        "n",
    ),
    (
        "/v1/chat/completions",
        "a json_schema response format without a schema",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        "a response format schema that does not compile",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            },
        },
        "response_format",
    ),
    (
        "/v1/chat/completions",
        "a seed that is not an integer",
        {"messages": [{"role": "user", "content": "x"}], "seed": "s"},
        "seed",
    ),
    (
        "/v1/chat/completions",
        "top_logprobs without logprobs",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        "continuous_usage_stats that is not a boolean",
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"continuous_usage_stats": "yes"},
        },
        "stream_options.continuous_usage_stats",
    ),
    ("/v1/completions", "a prompt that is a number", {"prompt": 5}, "prompt"),
    ("/v1/completions", "negative max_tokens", {"prompt": "x", "max_tokens": -2}, "max_tokens"),
    (
        "/v1/completions",
        "a frequency penalty out of range",
        {"prompt": "x", "frequency_penalty": 3},
        "frequency_penalty",
    ),
    (
        "/v1/completions",
        "a list of prompts with a bad one",
        {"prompt": ["x", 5]},
        "prompt[1]",
    ),
]


@pytest.mark.parametrize(("path", "what", "body", "field"), CASES, ids=[c[1] for c in CASES])
def test_bad_request_answers_400_naming_the_field(
    shared_server: EngineServer, path: str, what: str, body: Any, field: str
) -> None:
    status, out = shared_server.http.post(path, body)
    assert status == 400, f"{what}: {status} {out}"
    assert field in out["error"]["message"], out
    assert out["success"] is False


@pytest.mark.parametrize(
    "path", ["/generate", "/v1/chat/completions", "/update_weights_from_tensor"]
)
def test_malformed_json_answers_400(shared_server: EngineServer, path: str) -> None:
    status, out, _ = shared_server.http.request("POST", path, raw=b'{"text": "a",')
    assert status == 400
    assert "malformed JSON" in out["error"]["message"]


def test_router_added_fields_are_ignored(shared_server: EngineServer) -> None:
    # sglang-router / smg re-serialise bodies and add these fields.
    extra = {
        "model": None,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "return_text_in_logprobs": False,
    }
    status, out = shared_server.http.post("/generate", {**OK, **extra})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2


def test_the_engine_still_serves_after_bad_requests(shared_server: EngineServer) -> None:
    for _, _, body, _ in CASES[:5]:
        shared_server.http.post("/generate", body)
    assert shared_server.http.post("/generate", OK)[0] == 200
