"""SGLang's other routes: tokenizer, scoring, a model's card, the OpenAI Responses API."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from relax_hf.responses_api import _status
from relax_hf.testing import EngineServer
from relax_hf.tiny import CHAT_TEMPLATE

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def client(shared_server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="none", max_retries=0)


# -- tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_answers_the_ids_generate_would_run(
    shared_server: EngineServer, tokenizer: Any, path: str
) -> None:
    out = shared_server.http.ok(path, {"prompt": "Hello world"})
    ids = tokenizer("Hello world")["input_ids"]
    assert out == {"tokens": ids, "count": len(ids), "max_model_len": 4096}
    gen = shared_server.http.ok("/generate", {"text": "Hello world", "sampling_params": GREEDY})
    assert gen["meta_info"]["prompt_tokens"] == len(ids)
    many = shared_server.http.ok(path, {"prompt": ["a", "b c"], "add_special_tokens": False})
    assert many["tokens"] == [
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["a", "b c"]
    ]
    assert many["count"] == [len(t) for t in many["tokens"]]


def test_tokenize_renders_messages_with_the_chat_template(
    shared_server: EngineServer, tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    out = shared_server.http.ok("/v1/tokenize", {"messages": messages})
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out["tokens"] == list(expected)


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
def test_detokenize_inverts_tokenize(shared_server: EngineServer, path: str) -> None:
    ids = shared_server.http.ok("/tokenize", {"prompt": "The sea is calm"})["tokens"]
    assert shared_server.http.ok(path, {"tokens": ids}) == {"text": "The sea is calm"}
    both = shared_server.http.ok(path, {"tokens": [ids, ids[:1]]})["text"]
    assert both[0] == "The sea is calm" and len(both) == 2
    status, err = shared_server.http.post(path, {"tokens": [1, 10**6]})
    assert status == 400 and "out of vocabulary" in err["message"] and err["param"] == "tokens"


#: A chat template that writes the tools it gets (the tiny model's ignores them).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"description": "The time.", "name": "get_time"}}


@pytest.fixture(scope="module")
def tools_server(
    start_server: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> EngineServer:
    """The tiny model with :data:`TOOLS_TEMPLATE` as its chat template."""
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("tools-template")
    for f in tiny_model.iterdir():
        shutil.copy(f, model / f.name)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(model)
    return start_server("hf-tools-template", model=model)  # type: ignore[no-any-return]


def test_tokenize_passes_tools_to_the_chat_template_as_sglang(
    tools_server: EngineServer, tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    def tokenize(**kw: Any) -> list[int]:
        return tools_server.http.ok("/v1/tokenize", {"messages": messages, **kw})["tokens"]  # type: ignore[no-any-return]

    def rendered(tools: list[dict[str, Any]] | None) -> list[int]:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # SGLang's Tool.model_dump(): description and parameters written as null when missing,
    # the function's keys in the order the client sent them, the tool's defer_loading.
    weather = {
        "type": "function",
        "function": {**WEATHER["function"], "description": None},  # type: ignore[dict-item]
        "defer_loading": None,
    }
    time_ = {"type": "function", "function": {**TIME["function"], "parameters": None}}
    time_["defer_loading"] = None
    assert tokenize() == rendered(None)
    assert tokenize(tools=[WEATHER, TIME]) == rendered([weather, time_]) != rendered(None)
    assert tokenize(tools=[WEATHER, TIME], tool_choice="auto") == rendered([weather, time_])
    assert tokenize(tools=[WEATHER, TIME], tool_choice="none") == rendered(None)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tokenize(tools=[WEATHER, TIME], tool_choice=named) == rendered([time_])
    # The chat route runs the same prompt (the openai client sends tools and tool_choice).
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="any",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        max_tokens=1,
        temperature=0,
    )
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(rendered([weather, time_]))
    status, err = tools_server.http.post(
        "/v1/tokenize", {"messages": messages, "tools": [{"type": "function"}]}
    )
    assert status == 400 and err["param"] == "tools[0]", err


# -- a model's card ---------------------------------------------------------------------------


def test_a_models_card_is_retrieved_by_its_name(client: openai.OpenAI) -> None:
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert "The model 'no-such-model' does not exist" in str(info.value)


# -- scoring ----------------------------------------------------------------------------------


def test_scores_are_the_label_probabilities_after_query_and_item(
    shared_server: EngineServer,
) -> None:
    labels = [5, 9, 17]
    body = {
        "query": "Is the sea blue? Answer:",
        "items": [" yes", " no"],
        "label_token_ids": labels,
    }
    out = shared_server.http.ok("/v1/score", body)
    assert out["object"] == "scoring" and len(out["scores"]) == 2
    for item, row in zip(body["items"], out["scores"], strict=True):
        ref = shared_server.http.ok(
            "/generate",
            {
                "text": body["query"] + item,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "token_ids_logprob": labels,
            },
        )["meta_info"]["output_token_ids_logprobs"][0]
        assert row == pytest.approx([math.exp(lp) for lp, _, _ in ref], rel=1e-5)
    soft = shared_server.http.ok("/v1/score", {**body, "apply_softmax": True})["scores"]
    assert all(sum(r) == pytest.approx(1.0) for r in soft)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] > 0


def test_scoring_takes_token_ids_item_first_and_labels_per_item(
    shared_server: EngineServer,
) -> None:
    body = {
        "query": [40, 41, 42],
        "items": [[7, 8], [9]],
        "item_first": True,
        "label_token_ids": [[1, 2], [3]],
        "return_token_logprobs": True,
    }
    out = shared_server.http.ok("/v1/score", body)
    assert [len(r) for r in out["scores"]] == [2, 1]
    assert [len(r) for r in out["token_logprobs"]] == [2, 1]
    ref = shared_server.http.ok(
        "/generate",
        {
            "input_ids": [9, 40, 41, 42],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "token_ids_logprob": [3],
        },
    )["meta_info"]["output_token_ids_logprobs"][0][0][0]
    assert out["token_logprobs"][1][0] == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"query": "q", "items": ["a"]}, "label_token_ids", "label_token_ids is required"),
        (
            {"query": "q", "items": ["a"], "label_token_ids": [1], "temperature": 0.5},
            "temperature",
            "temperature requires apply_softmax=True",
        ),
        (
            {"query": "q", "items": ["a"], "label_token_ids": [10**6]},
            "label_token_ids",
            "is out of vocabulary",
        ),
        (
            {
                "query": "q",
                "items": ["a"],
                "label_token_ids": [1],
                "return_pooled_hidden_states": True,
            },
            "return_pooled_hidden_states",
            "not supported for CausalLM",
        ),
    ],
)
def test_bad_scoring_requests_answer_400_naming_the_field(
    shared_server: EngineServer, body: dict[str, Any], param: str, needle: str
) -> None:
    status, err = shared_server.http.post("/v1/score", body)
    assert status == 400 and err["param"] == param and needle in err["message"], err


# -- the Responses API ------------------------------------------------------------------------


def test_a_response_answers_one_message_with_its_usage(
    client: openai.OpenAI, shared_server: EngineServer, tokenizer: Any
) -> None:
    shared_server.http.ok("/flush_cache")
    resp = client.responses.create(
        model="tiny", input="Tell me about the sea.", max_output_tokens=8, temperature=0
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert len(resp.output) == 1 and resp.output[0].type == "message"
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )  # type: ignore[arg-type]
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_items_make_the_chat(client: openai.OpenAI) -> None:
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
    ]
    resp = client.responses.create(model="tiny", input=items, max_output_tokens=4, temperature=0)  # type: ignore[arg-type]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello"},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert resp.output_text == chat.choices[0].message.content


def test_a_previous_response_continues_its_conversation_from_the_cache(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model="tiny", input="Remember the number seven.", max_output_tokens=6, temperature=0
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model="tiny",
        input="Which number?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # The first turn's prompt is not prefilled again.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(
            model="tiny", input="x", previous_response_id="resp_nope", max_output_tokens=2
        )
    assert "Response with id 'resp_nope' not found." in str(info.value)


def test_a_malformed_response_id_is_a_400_as_in_sglang(
    client: openai.OpenAI, shared_server: EngineServer
) -> None:
    # SGLang tells an id that cannot be a response's (every one begins with resp_) from one
    # it does not hold (404, above).
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model="tiny", input="x", previous_response_id="nope", max_output_tokens=2
        )
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert "Invalid 'response_id': 'nope'. Expected an ID that begins with 'resp'." in str(
        info.value
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.retrieve("nope")
    assert info.value.body["param"] == "response_id"  # type: ignore[index]
    status, _ = shared_server.http.get("/v1/responses/resp_nope")
    assert status == 404


SERVING_RESPONSES = "srt/entrypoints/openai/serving_responses.py"


def test_a_length_finish_is_incomplete_with_sglangs_status_event_and_usage(
    client: openai.OpenAI, sglang_source: Any
) -> None:
    # As SGLang 0.5.23's Responses server: the status of a finish reason, the stream's last
    # event named after it, and the usage's keys (protocol.ResponsesResponse's serializer).
    status_of = sglang_source.function(
        SERVING_RESPONSES, "_status_from_finish_reason", "OpenAIServingResponses"
    )
    for reason in ({"type": "length", "length": 1}, {"type": "stop", "matched": 5}):
        assert _status(reason) == status_of(reason)
    assert _status({"type": "abort", "message": "x"}) == status_of({"type": "abort"}) == "failed"
    kw: dict[str, Any] = {"model": "tiny", "input": "Once", "max_output_tokens": 1}
    whole = client.responses.create(**kw, temperature=0)
    assert whole.status == status_of({"type": "length"}) == "incomplete"
    events = list(client.responses.create(**kw, temperature=0, stream=True))
    assert events[-1].type == f"response.{whole.status}"
    usage_keys = sglang_source.returned_keys(
        "srt/entrypoints/openai/protocol.py", "_serialize_usage", "ResponsesResponse"
    )
    assert whole.usage is not None
    assert sorted(whole.usage.model_dump()) == sorted(usage_keys)


def test_a_streamed_response_sends_the_event_sequence_and_the_same_text(
    client: openai.OpenAI,
) -> None:
    kw: dict[str, Any] = {
        "model": "tiny",
        "input": "Once upon a time",
        "max_output_tokens": 10,
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text  # type: ignore[union-attr]


def test_what_the_engine_cannot_do_is_refused_not_ignored(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    for kw, param in (
        ({"tools": [tool]}, "tools"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny", input="x", max_output_tokens=2, **kw)
        assert info.value.body["param"] == param  # type: ignore[index]
