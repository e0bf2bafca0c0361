"""SGLang's own frontend language and the official ``openai`` client against ``relax-hf serve``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from relax_hf.testing import EngineServer

PROGRAM = Path(__file__).with_name("sglang_frontend_program.py")


def test_sglangs_frontend_language_runs_against_the_engine(shared_server: EngineServer) -> None:
    # In its own process: see the program's docstring for why sglang.lang is imported there.
    done = subprocess.run(
        [sys.executable, str(PROGRAM), shared_server.url],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    direct = shared_server.http.generate(
        "Question: what is two plus two?\nAnswer:",
        sampling_params={"max_new_tokens": 8, "temperature": 0},
    )
    assert out["single"] == direct["text"]  # sgl.gen is /generate underneath
    assert len(out["batch"]) == 3 and all(isinstance(a, str) for a in out["batch"])
    assert "".join(out["stream_chunks"]) == out["stream_answer"] == out["single"]
    assert out["selected"] in (" blue", " red", " green") and out["select_meta"]
    assert out["number"].isdigit() and 1 <= len(out["number"]) <= 3  # sgl.gen(regex=…)


@pytest.fixture(scope="module")
def client(shared_server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="none", max_retries=0)


def test_openai_chat_generation_with_n_and_seed(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hello"}]
    a = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, n=3, seed=7, temperature=1.0
    )
    b = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, n=3, seed=7, temperature=1.0
    )
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # seed reproduces
    assert len(set(texts)) > 1
    assert a.usage is not None and a.usage.prompt_tokens > 0  # the prompt, counted once
    assert a.usage.completion_tokens >= 3


def test_openai_chat_stream_and_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 for t in content)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == whole.choices[0].message.content


def test_openai_completions_batch_and_stream(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The sea is"]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    singles = [
        client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    assert [c.text for c in batch.choices] == singles
    parts: dict[int, str] = {0: "", 1: ""}
    for chunk in client.completions.create(
        model="tiny", prompt=prompts, max_tokens=5, temperature=0, stream=True
    ):
        for c in chunk.choices:
            parts[c.index] += c.text
    assert [parts[0], parts[1]] == singles


def test_openai_choice_selection_by_logprobs(client: openai.OpenAI) -> None:
    # Score each continuation with echo + logprobs + max_tokens 0 (no generation), then pick
    # the one with the highest total: the classic completions-API way to choose.
    prefix = "The colour of the sea is"
    choices = [" blue", " red", " green"]
    out = client.completions.create(
        model="tiny",
        prompt=[prefix + c for c in choices],
        max_tokens=0,
        echo=True,
        logprobs=1,
        temperature=0,
    )
    scores = []
    for choice, text in zip(out.choices, choices, strict=True):
        assert choice.text == prefix + text  # echo
        lps = choice.logprobs.token_logprobs  # type: ignore[union-attr]
        assert lps[0] is None and all(v is not None and v <= 0 for v in lps[1:])
        scores.append(sum(lps[1:]))
    assert len(set(scores)) == 3
    best = choices[scores.index(max(scores))]
    assert best in choices
