"""Streaming through the gateway, role adapters from the installed plugins, the openai client.

Real uvicorn gateways in front of real upstream server processes on loopback.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relax_core import PluginManager
from relax_core.testing import wait_for
from tests.support import gateway as gs


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with gs.upstream("math-0") as a:
        yield a


@pytest.fixture
def gw(engine: Any) -> Iterator[str]:
    registry = gs.Registry(gs.snapshot("rollout", {"policy": {"urls": [engine.url]}}))
    with gs.gateway("rollout", registry) as url:
        yield url


def raw_post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return bytes(resp.read())


def test_sse_relay_is_byte_identical_to_the_direct_stream(gw: str, engine: Any) -> None:
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 200}}
    direct = raw_post(f"{engine.url}/generate", body)
    relayed = raw_post(f"{gw}/rollout/generate", body)
    assert relayed == direct
    assert direct.count(b"\n\n") == 201 and direct.endswith(b"data: [DONE]\n\n")


def test_client_disconnect_closes_the_upstream_stream(gw: str, engine: Any) -> None:
    before = engine.stats()["streams_closed_early"]
    gs.leave_a_stream(
        f"{gw}/rollout/generate",
        {"text": "hi", "stream": True},
        headers={"X-Test-Mode": "hang-stream"},
    )
    wait_for(
        lambda: engine.stats()["streams_closed_early"] == before + 1,
        timeout=10,
        what="the upstream to see its stream closed",
    )
    metrics = urllib.request.urlopen(f"{gw}/metrics", timeout=10).read().decode()
    assert 'route="generate",status="499"} 1.0' in metrics


def test_engine_killed_mid_stream_truncates_without_switching_replica() -> None:
    with gs.upstream("a") as a, gs.upstream("b") as b:
        registry = gs.Registry(gs.snapshot("rollout", {"policy": {"urls": [a.url, b.url]}}))
        with gs.gateway("rollout", registry) as url:

            async def go() -> tuple[bytes, BaseException | None]:
                got = b""
                async with aiohttp.ClientSession() as session:
                    try:
                        async with session.post(
                            f"{url}/rollout/generate",
                            json={
                                "text": "x",
                                "stream": True,
                                "sampling_params": {"max_new_tokens": 50},
                            },
                            headers={"X-Test-Mode": "die-after:2"},
                        ) as resp:
                            assert resp.status == 200
                            async for chunk in resp.content.iter_any():
                                got += chunk
                    except aiohttp.ClientPayloadError as exc:
                        return got, exc
                return got, None

            got, error = asyncio.run(go())
            metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        assert error is not None, "a stream cut by a dead engine must not end cleanly"
        events = got.split(b"\n\n")
        assert [e.startswith(b"data: {") for e in events[:3]] == [True] * 3, got
        assert b"[DONE]" not in got
        # The last event before the cut says why, in the shape SGLang uses for stream errors.
        last = json.loads(events[2].removeprefix(b"data: "))["error"]
        assert last["code"] == 502 and "failed after" in last["message"]
        states = [u.proc.poll() for u in (a, b)]
        assert sorted(s is None for s in states) == [False, True], "exactly one engine died"
        survivor = a if states[0] is None else b
        assert survivor.stats()["requests"] == 0, "the request must not be replayed elsewhere"
        assert (
            'relax_gateway_upstream_errors_total{error="stream_aborted",role="rollout"} 1.0'
            in metrics
        )


def test_openai_client_works_streaming_and_not(engine: Any) -> None:
    import openai

    registry = gs.Registry(
        gs.snapshot("rollout", {"policy": {"urls": [engine.url], "served": "Org/Policy-1"}})
    )
    with gs.gateway("rollout", registry, token="tok") as url:
        client = openai.OpenAI(base_url=f"{url}/rollout/v1", api_key="tok", max_retries=0)
        out = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert out.choices[0].message.content == "math-0: tok0 tok1 tok2 tok3"
        assert out.model == "Org/Policy-1"
        pieces = [
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                stream=True,
            )
        ]
        assert "".join(pieces) == "tok0 tok1 tok2 "
        models = client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        bad = openai.OpenAI(base_url=f"{url}/rollout/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}]
            )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(gs.make_tokenizer(tmp_path_factory.mktemp("judge-tok")))


def test_genrm_messages_are_rendered_forwarded_as_input_ids_and_answered_as_response(
    engine: Any, tokenizer_dir: Path, plugin_manager: PluginManager
) -> None:
    from transformers import AutoTokenizer

    registry = gs.Registry(
        gs.snapshot("genrm", {"judge": {"urls": [engine.url]}}, route_key_map={"k": "judge"})
    )
    with gs.gateway(
        "genrm", registry, plugin_manager=plugin_manager, model_paths={"judge": str(tokenizer_dir)}
    ) as url:
        messages = [{"role": "user", "content": "is 4 correct?"}]
        status, _, body = gs.post(f"{url}/genrm/generate", {"messages": messages, "route_key": "k"})
        assert status == 200, body
        assert json.loads(body) == {"response": "math-0:token2"}
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert engine.last()["body"] == {
            "input_ids": tok.encode(rendered, add_special_tokens=False)
        }
        raw = gs.post(f"{url}/genrm/generate", {"input_ids": [5, 6]})
        assert raw[0] == 200 and json.loads(raw[2])["text"] == "math-0:token2"
        status, _, body = gs.post(f"{url}/genrm/generate", {"messages": messages, "stream": True})
        assert status == 400 and json.loads(body)["error"]["param"] == "stream"


def test_teacher_gateway_uses_the_teacher_plugins_prefill_checks(
    engine: Any, plugin_manager: PluginManager
) -> None:
    registry = gs.Registry(gs.snapshot("teacher", {"math": {"urls": [engine.url]}}))
    before = engine.stats()["requests"]
    with gs.gateway("teacher", registry, plugin_manager=plugin_manager) as url:
        status, _, body = gs.post(
            f"{url}/teacher/generate", {"input_ids": [1, 2], "top_logprobs_num": 3}
        )
        assert status == 400 and "return_logprob" in body.decode()
        assert engine.stats()["requests"] == before
        status, _, _ = gs.post(
            f"{url}/teacher/generate",
            {
                "input_ids": [1, 2, 3],
                "return_logprob": True,
                "logprob_start_len": 1,
                "top_logprobs_num": 2,
            },
        )
        assert status == 200


def test_genrm_request_makes_one_routing_decision(
    tokenizer_dir: Path, plugin_manager: PluginManager
) -> None:
    # The genrm adapter needs the model before it builds the body; the replica chosen then is
    # the one the request goes to, so round-robin advances once per request.
    with gs.upstream("a") as a, gs.upstream("b") as b:
        registry = gs.Registry(gs.snapshot("genrm", {"judge": {"urls": [a.url, b.url]}}))
        with gs.gateway(
            "genrm",
            registry,
            plugin_manager=plugin_manager,
            model_paths={"judge": str(tokenizer_dir)},
            snapshot_ttl=60.0,
        ) as url:
            messages = [{"role": "user", "content": "is 4 correct?"}]
            for _ in range(8):
                status, _, body = gs.post(f"{url}/genrm/generate", {"messages": messages})
                assert status == 200, body
        assert (a.stats()["requests"], b.stats()["requests"]) == (4, 4)


def test_stalled_stream_ends_with_a_504_error_event_and_a_cut_connection(engine: Any) -> None:
    import signal

    with gs.upstream("stall") as up:
        registry = gs.Registry(gs.snapshot("rollout", {"policy": {"urls": [up.url]}}))
        try:
            with gs.gateway("rollout", registry, stream_idle_timeout=0.5, timeout=120) as url:

                async def go() -> tuple[bytes, BaseException | None]:
                    got = b""
                    async with aiohttp.ClientSession() as session:
                        try:
                            async with session.post(
                                f"{url}/rollout/generate",
                                json={"text": "x", "stream": True},
                                headers={"X-Test-Mode": "hang-stream"},
                            ) as resp:
                                assert resp.status == 200
                                async for chunk in resp.content.iter_any():
                                    if not got:
                                        # The engine stops dead; its socket stays open.
                                        up.proc.send_signal(signal.SIGSTOP)
                                    got += chunk
                        except aiohttp.ClientPayloadError as exc:
                            return got, exc
                    return got, None

                got, error = asyncio.run(go())
                metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        finally:
            up.proc.send_signal(signal.SIGCONT)
    assert error is not None, "a stalled stream must not end cleanly"
    events = got.split(b"\n\n")
    assert events[0].startswith(b"data: {") and b"[DONE]" not in got
    last = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert last["code"] == 504 and last["type"] == "gateway_timeout"
    assert "sent nothing for 0.5s in the middle of its streamed answer" in last["message"]
    assert (
        'relax_gateway_upstream_errors_total{error="stream_stalled",role="rollout"} 1.0' in metrics
    )
    assert (
        'relax_gateway_requests_total{role="rollout",route="generate",status="504"} 1.0' in metrics
    )
