"""OpenAI-compatible routes: chat template, completions, streaming chunks, logprobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax_hf.testing import EngineServer

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Say hello"}],
    "max_tokens": 6,
    "temperature": 0,
}


def _chunks(events: list[bytes]) -> list[dict[str, Any]]:
    assert events[-1] == b"data: [DONE]\n\n"
    return [json.loads(e[len(b"data: ") : -2]) for e in events[:-1]]


def test_chat_uses_the_tokenizers_chat_template(
    shared_server: EngineServer, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    raw = shared_server.http.generate(
        input_ids=ids, text=None, sampling_params={"max_new_tokens": 6, "temperature": 0}
    )
    out = shared_server.http.ok("/v1/chat/completions", CHAT)
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": raw["text"],
        "reasoning_content": None,  # SGLang's ChatMessage: null without a reasoning parser
    }
    n = raw["meta_info"]["completion_tokens"]
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": n,
        "total_tokens": len(ids) + n,
    }
    assert choice["finish_reason"] in ("stop", "length")


def test_chat_stream_deltas_add_up_to_the_whole_answer(shared_server: EngineServer) -> None:
    whole = shared_server.http.ok("/v1/chat/completions", CHAT)["choices"][0]["message"]["content"]
    chunks = _chunks(shared_server.http.stream("/v1/chat/completions", {**CHAT, "stream": True}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_stream_deltas_carry_reasoning_content_as_sglangs(
    shared_server: EngineServer,
) -> None:
    # SGLang's StreamDelta: reasoning_content in every delta (null without a reasoning
    # parser), role and content only where set; SGLang's clients read the key.
    import openai

    chunks = _chunks(shared_server.http.stream("/v1/chat/completions", {**CHAT, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert all(set(d) == {"reasoning_content", "content"} for d in deltas[1:-1])
    assert deltas[-1] == {"reasoning_content": None}  # the finish chunk
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
    seen = [c.choices[0].delta for c in stream]
    assert seen and all(d.model_extra == {"reasoning_content": None} for d in seen)


def test_chat_logprobs_follow_openais_shape(shared_server: EngineServer) -> None:
    out = shared_server.http.ok(
        "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}
    )
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]


def test_completions_answer_text_and_stream(shared_server: EngineServer) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    out = shared_server.http.ok("/v1/completions", body)
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 5
    direct = shared_server.http.generate(
        "Once upon a time", sampling_params={"max_new_tokens": 5, "temperature": 0}
    )
    assert out["choices"][0]["text"] == direct["text"]
    chunks = _chunks(shared_server.http.stream("/v1/completions", {**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == direct["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_accept_token_ids(shared_server: EngineServer) -> None:
    out = shared_server.http.ok(
        "/v1/completions", {"prompt": [10, 20, 30], "max_tokens": 3, "temperature": 0}
    )
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
