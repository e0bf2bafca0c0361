"""Custom logit processors behind ``--enable-custom-logit-processor``, serialized by SGLang's
own ``CustomLogitProcessor.to_str()`` (SGLang's classes and classes of a client's script), sent
through ``/generate`` and through the official ``openai`` client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from relax_hf.testing import EngineServer

PROGRAM = Path(__file__).with_name("sglang_logit_processors.py")
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def processors() -> dict[str, str]:
    """``{name: serialized}`` from SGLang's ``to_str()``, in a client process of its own."""
    done = subprocess.run(
        [sys.executable, str(PROGRAM)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def server(start_server: Any) -> EngineServer:
    return start_server("hf-clp", extra_args=("--enable-custom-logit-processor",))  # type: ignore[no-any-return]


def _ids(server: EngineServer, **body: Any) -> list[int]:
    out = server.http.ok("/generate", {"text": "Once upon a time", **body})
    ids: list[int] = out["output_ids"]
    return ids


def test_sglangs_disallowed_tokens_processor_bans_them(
    server: EngineServer, processors: dict[str, str]
) -> None:
    free = _ids(server, sampling_params=GREEDY)
    banned = sorted(set(free))
    ids = _ids(
        server,
        sampling_params={**GREEDY, "custom_params": {"token_ids": banned}},
        custom_logit_processor=processors["disallowed"],
    )
    assert ids != free and not set(ids) & set(banned)
    assert _ids(server, sampling_params=GREEDY) == free  # nothing stays behind


def test_a_scripts_processor_reads_its_params_and_request(
    server: EngineServer, processors: dict[str, str]
) -> None:
    # A batch: the first prompt's rows run the processor, the second's do not.
    free = _ids(server, text="The sea is", sampling_params=GREEDY)
    out = server.http.ok(
        "/generate",
        {
            "text": ["Once upon a time", "The sea is"],
            "sampling_params": [{**GREEDY, "custom_params": {"start": 40}}, GREEDY],
            "custom_logit_processor": [processors["count_up"], None],
        },
    )
    assert out[0]["output_ids"] == [40, 41, 42, 43, 44, 45]
    assert out[1]["output_ids"] == free


def test_the_openai_client_sends_a_processor_to_chat_and_completions(
    server: EngineServer, processors: dict[str, str]
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    extra = {"custom_logit_processor": processors["count_up"], "custom_params": {"start": 50}}
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        extra_body=extra,
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    tokens = [t.token for t in chat.choices[0].logprobs.content]
    detok = server.http.ok("/detokenize", {"tokens": [50, 51, 52, 53]})
    assert "".join(tokens) == detok["text"]
    done = client.completions.create(
        model="tiny", prompt="hi", max_tokens=3, temperature=0, extra_body=extra
    )
    assert done.choices[0].text == server.http.ok("/detokenize", {"tokens": [50, 51, 52]})["text"]


@pytest.mark.parametrize(("name", "error"), [("raises", "boom"), ("wrong_shape", "shape")])
def test_a_failing_processor_aborts_its_request_only(
    server: EngineServer, processors: dict[str, str], name: str, error: str
) -> None:
    free = _ids(server, text="The sea is", sampling_params=GREEDY)
    out = server.http.ok(
        "/generate",
        {
            "text": ["Once upon a time", "The sea is"],
            "sampling_params": [{**GREEDY, "custom_params": {}}, GREEDY],
            "custom_logit_processor": [processors[name], None],
        },
    )
    reason = out[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and error in reason["message"], reason
    assert out[0]["output_ids"] == []  # no token drawn from logits it did not rewrite
    assert out[1]["output_ids"] == free


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("not json", "not a serialized processor"),
        ('{"callable": "00ff"}', "does not load"),
        (7, "CustomLogitProcessor.to_str()"),
    ],
)
def test_a_processor_that_does_not_load_is_a_400(
    server: EngineServer, value: Any, words: str
) -> None:
    status, out = server.http.post("/generate", {"text": "a", "custom_logit_processor": value})
    assert status == 400, out
    assert "custom_logit_processor" in out["error"]["message"]
    assert words in out["error"]["message"]
