"""SGLang's semantics where they differed: ignored fields, per-prompt log-probs, the context
bound, its error words, the sampling mask, stream framing, and the info routes' fields."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import openai
import pytest
from relax_hf.testing import EngineServer

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(e[len(b"data: ") :]) for e in raw if e.startswith(b"data: {")]


@pytest.fixture(scope="module")
def client(shared_server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="none", max_retries=0)


# -- /generate --------------------------------------------------------------------------------


def test_top_logprobs_num_without_return_logprob_is_ignored_as_sglang_does(
    shared_server: EngineServer,
) -> None:
    for extra in ({"top_logprobs_num": 3}, {"token_ids_logprob": [1, 2]}):
        out = shared_server.http.ok("/generate", {"text": "a", "sampling_params": GREEDY, **extra})
        assert "output_token_logprobs" not in out["meta_info"]


def test_a_batch_takes_one_token_ids_logprob_list_per_prompt(shared_server: EngineServer) -> None:
    body = {
        "input_ids": [[10, 11, 12], [20, 21]],
        "sampling_params": GREEDY,
        "return_logprob": [True, True],
        "top_logprobs_num": [2, 0],
        "token_ids_logprob": [[1, 2, 3], [4]],
    }
    a, b = shared_server.http.ok("/generate", body)
    assert [len(e) for e in a["meta_info"]["output_token_ids_logprobs"]] == [3] * 4
    assert [e[0][1] for e in b["meta_info"]["output_token_ids_logprobs"]] == [4] * 4
    assert "output_top_logprobs" in a["meta_info"]
    assert "output_top_logprobs" not in b["meta_info"]


def test_max_new_tokens_beyond_the_context_answers_400_in_sglangs_words(
    shared_server: EngineServer,
) -> None:
    status, err = shared_server.http.post(
        "/generate", {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 4090}}
    )
    assert status == 400
    assert (
        "Requested token count exceeds the model's maximum context length of 4096"
        in (err["message"])
    )
    # Without an explicit max_new_tokens SGLang does not check (the default finishes early).
    assert shared_server.http.post("/generate", {"input_ids": [5] * 4090})[0] == 200
    status, err = shared_server.http.post("/generate", {"input_ids": [5] * 4096})
    assert status == 400
    assert (
        "The input (4096 tokens) is longer than the model's context length (4096"
        in (err["message"])
    )


def test_chat_max_tokens_beyond_the_context_answers_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5000
        )
    assert "maximum context length of 4096 tokens" in str(info.value)


def test_a_request_id_in_flight_answers_sglangs_duplicate_message(
    shared_server: EngineServer,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from relax_core.testing import wait_for

    long = {
        "text": "x",
        "rid": "dup",
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(shared_server.http.post, "/generate", long)
        wait_for(
            lambda: shared_server.http.ok("/server_info")["num_running_reqs"] >= 1,
            timeout=30,
            what="the first request to run",
        )
        status, err = shared_server.http.post("/generate", long)
        shared_server.http.ok("/abort_request", {"rid": "dup"})
        fut.result(timeout=60)
    assert status == 400 and "Duplicate request ID detected: dup" in err["message"]


# -- the sampling mask ------------------------------------------------------------------------


def test_the_sampling_mask_is_the_top_k_support_with_behaviour_logprobs(
    shared_server: EngineServer,
) -> None:
    sampling = {"max_new_tokens": 5, "temperature": 0.8, "top_k": 5, "sampling_seed": 3}
    body = {"text": "The sea", "sampling_params": sampling, "return_sampling_mask": True}
    meta = shared_server.http.ok("/generate", body)
    masks = meta["meta_info"]["output_token_sampling_mask"]
    values = meta["meta_info"]["output_token_sampling_logprobs"]
    assert meta["meta_info"]["output_token_sampling_mask_length"] == len(masks) == 5
    for tok, mask, lp in zip(meta["output_ids"], masks, values, strict=True):
        assert len(mask) == 5 and tok in mask and lp <= 0
    support = shared_server.http.ok("/generate", {**body, "sampling_logprobs_mode": "support"})[
        "meta_info"
    ]
    assert support["output_token_sampling_mask"] == masks  # same seed, same draws
    for lps, tok, mask, lp in zip(
        support["output_token_sampling_logprobs"], meta["output_ids"], masks, values, strict=True
    ):
        assert sum(math.exp(v) for v in lps) == pytest.approx(1.0, abs=1e-4)
        assert lps == sorted(lps, reverse=True) and lps[mask.index(tok)] == pytest.approx(lp)
    # The mask does not change what is drawn.
    plain = shared_server.http.ok("/generate", {"text": "The sea", "sampling_params": sampling})
    assert plain["output_ids"] == meta["output_ids"]


def test_a_greedy_sampling_mask_is_the_chosen_token(shared_server: EngineServer) -> None:
    out = shared_server.http.ok(
        "/generate", {"text": "a", "sampling_params": GREEDY, "return_sampling_mask": True}
    )
    meta = out["meta_info"]
    assert meta["output_token_sampling_mask"] == [[t] for t in out["output_ids"]]
    assert meta["output_token_sampling_logprobs"] == [0.0] * 4


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"return_sampling_mask": True}, "return_sampling_mask requires top_k=1"),
        ({"sampling_logprobs_mode": "support"}, "can only be set when return_sampling_mask=true"),
    ],
)
def test_a_sampling_mask_sglang_would_refuse_answers_400(
    shared_server: EngineServer, extra: dict[str, Any], needle: str
) -> None:
    body = {"text": "a", "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}, **extra}
    status, err = shared_server.http.post("/generate", body)
    assert status == 400 and needle in err["message"], err


# -- stream framing ---------------------------------------------------------------------------


def test_a_chat_stream_sends_usage_in_a_last_chunk_without_choices(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.chat.completions.create(
            **CHAT, model="tiny", stream=True, stream_options={"include_usage": True}
        )  # type: ignore[call-overload]
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 6
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].usage is None
    plain = list(client.chat.completions.create(**CHAT, model="tiny", stream=True))  # type: ignore[call-overload]
    assert all(c.usage is None for c in plain) and plain[-1].choices


def test_a_chat_stream_carries_logprobs_when_asked(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            **CHAT, model="tiny", stream=True, logprobs=True, top_logprobs=2
        )  # type: ignore[call-overload]
    )
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)


def test_a_completion_stream_carries_logprobs_and_usage_when_asked(
    shared_server: EngineServer,
) -> None:
    body = {"prompt": "Once upon", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    whole = shared_server.http.ok("/v1/completions", body)["choices"][0]["logprobs"]
    events = _events(
        shared_server.http.stream(
            "/v1/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert all(c["logprobs"] is not None for c in choices if c["text"])
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def _stream_usage(**options: bool) -> dict[str, Any]:
    # continuous_usage_stats is SGLang's (and vLLM's) key: the openai client passes it through.
    return {"stream": True, "stream_options": options}


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_its_chunks(
    client: openai.OpenAI, shared_server: EngineServer
) -> None:
    chunks = list(
        client.chat.completions.create(
            **CHAT, model="tiny", n=2, **_stream_usage(continuous_usage_stats=True)
        )  # type: ignore[call-overload]
    )
    prompt = len(shared_server.http.ok("/v1/tokenize", {"messages": CHAT["messages"]})["tokens"])
    # Every chunk belongs to a choice and carries its usage; no usage-only chunk at the end.
    assert all(len(c.choices) == 1 and c.usage is not None for c in chunks)
    for i in (0, 1):
        mine = [c for c in chunks if c.choices[0].index == i]
        assert mine[0].choices[0].delta.role == "assistant"
        assert mine[-1].choices[0].finish_reason == "length"
        counts = [c.usage.completion_tokens for c in mine]  # type: ignore[union-attr]
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6
        for c in mine:
            assert c.usage is not None and c.usage.prompt_tokens == prompt
            assert c.usage.total_tokens == prompt + c.usage.completion_tokens
            assert c.usage.prompt_tokens_details is None  # no --enable-cache-report


def test_a_completion_stream_with_continuous_usage_ends_with_the_whole_usage(
    client: openai.OpenAI, shared_server: EngineServer
) -> None:
    prompts = ["Once upon", "The sea is"]
    lengths = [len(shared_server.http.ok("/tokenize", {"prompt": p})["tokens"]) for p in prompts]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompts,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
            **_stream_usage(include_usage=True, continuous_usage_stats=True),
        )  # type: ignore[call-overload]
    )
    *body, last = chunks
    seen: dict[int, list[int]] = {0: [], 1: []}
    for c in body:
        assert c.usage is not None and c.usage.prompt_tokens == lengths[c.choices[0].index]
        seen[c.choices[0].index].append(c.usage.completion_tokens)
    assert all(counts == sorted(counts) and counts[-1] == 5 for counts in seen.values())
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (sum(lengths), 10)


def _streamed_choices(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Each choice of a completion stream put back together: its text, its first chunk's text
    and its log-probs."""
    out: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for ch in c.choices:
            got = out.setdefault(
                ch.index, {"first": ch.text, "text": "", "tokens": [], "lps": [], "offsets": []}
            )
            got["text"] += ch.text
            if ch.logprobs is not None:
                got["tokens"] += ch.logprobs.tokens
                got["lps"] += ch.logprobs.token_logprobs
                got["offsets"] += ch.logprobs.text_offset
    return out


def test_echo_with_stream_leads_each_choice_with_its_prompt_and_its_logprobs(
    client: openai.OpenAI,
) -> None:
    prompts = ["The colour of the sea is", "Once upon"]
    kw = {"model": "tiny", "prompt": prompts, "max_tokens": 3, "temperature": 0, "echo": True}
    whole = client.completions.create(**kw, logprobs=1)
    streamed = _streamed_choices(list(client.completions.create(**kw, logprobs=1, stream=True)))
    assert sorted(streamed) == [0, 1]
    for i, prompt in enumerate(prompts):
        got, want = streamed[i], whole.choices[i]
        assert got["first"].startswith(prompt) and got["text"] == want.text
        assert want.logprobs is not None
        assert got["tokens"] == want.logprobs.tokens and got["offsets"] == want.logprobs.text_offset
        assert got["lps"][0] is None and want.logprobs.token_logprobs[0] is None  # SGLang's pad
        assert got["lps"][1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=1e-5)
    plain = _streamed_choices(list(client.completions.create(**kw, stream=True)))
    assert [plain[i]["text"] for i in (0, 1)] == [c.text for c in whole.choices]


def test_echo_with_stream_and_max_tokens_0_scores_each_prompt_in_one_chunk(
    client: openai.OpenAI,
) -> None:
    prompts = ["The sea is blue", "The sea is red"]
    kw = {"model": "tiny", "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert len(chunks) == 2 and {c.choices[0].index for c in chunks} == {0, 1}
    for c in chunks:
        choice = c.choices[0]
        want = whole.choices[choice.index]
        assert choice.text == prompts[choice.index] == want.text
        assert choice.finish_reason == "length" and choice.logprobs is not None
        assert want.logprobs is not None and choice.logprobs.tokens == want.logprobs.tokens


# -- info routes ------------------------------------------------------------------------------


def test_server_info_has_sglangs_startup_time_and_memory_usage(
    shared_server: EngineServer, sglang_source: Any
) -> None:
    # The shapes of SGLang 0.5.23's (observability/startup_time.py, memory_usage.py), with
    # the CUDA-graph phases read from its source.
    phases = sglang_source.constant(
        "srt/model_executor/graph_memory_usage.py", "GRAPH_MEMORY_USAGE_KEYS"
    )
    info = shared_server.http.ok("/server_info")
    startup = info["startup_time"]
    assert set(startup) == {
        "load_weight",
        "kv_cache_allocation",
        "scheduler_e2e",
        "cuda_graph",
        "tokenizer_e2e",
    }
    assert set(startup["cuda_graph"]) == set(phases)
    assert startup["cuda_graph"]["decode"] == 0.0  # a CPU engine captures no graph
    state = info["internal_states"][0]
    assert set(state["startup_time"]) == set(startup) - {"tokenizer_e2e"}  # the scheduler's
    usage = state["memory_usage"]
    keys = sglang_source.returned_keys(
        "srt/managers/scheduler_components/memory_usage.py", "build_memory_usage"
    )
    assert list(usage) == keys
    assert usage["token_capacity"] == info["max_total_num_tokens"]
    assert usage["token_capacity_swa"] is None  # no sliding-window layers
    assert usage["weight"] > 0 and usage["kvcache"] > 0 and usage["startup_available"] > 0
    assert usage["graph"] == dict.fromkeys(phases, 0.0)


def test_model_info_follows_a_disk_update(start_server: Any, tmp_path: Path) -> None:
    import shutil

    server = start_server("hf-model-path")
    first = server.http.ok("/model_info")["model_path"]
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    server.http.ok("/update_weights_from_disk", {"model_path": str(copy)})
    info = server.http.ok("/model_info")
    assert info["model_path"] == str(copy) and info["tokenizer_path"] == first
