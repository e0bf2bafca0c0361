"""The genrm gateway (the core's gateway with the genrm plugin's adapter) with real faults.

Real uvicorn gateways on threads of this process, as ``relax serve`` runs them; real
engine-protocol server processes behind them (``tests/support/upstream_server.py``); tokenizers
trained locally. A slow render is a real chat template that does real work (a long Jinja loop)
— what a long conversation costs a real template.

- Tokenizers load when the gateway starts, and ``/health`` is not ready until they have.
- A render runs off the gateway's event loop: a teacher request (another gateway of the same
  process) and a raw genrm request (the same gateway) sent while a render is running are not
  held up by it.
- After a render the chosen replica is checked again: one that went away meanwhile is not sent
  the request.
- The judge client reads the gateway's error shape and keeps its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relax_genrm import JudgeClient, judge_sample

from relax_core import GatewayOptions, PluginManager, UpstreamStatusError
from relax_core.gateway.serving import gateway_app
from relax_core.testing import serve_app, wait_for
from tests.support import gateway as gs

#: A chat template whose every render loops a million times first (about 1-3 s of CPU).
SLOW_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for j in range(10) %}{% for i in range(100000) %}"
    "{% set ns.n = ns.n + i %}{% endfor %}{% endfor %}" + gs.CHAT_TEMPLATE
)
MESSAGES = [{"role": "user", "content": "Is 2+2=4 correct?"}]


def _tokenizer(directory: Path, template: str) -> str:
    from transformers import AutoTokenizer

    gs.make_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    tok.chat_template = template
    tok.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def fast_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tokenizer(tmp_path_factory.mktemp("tok-fast"), gs.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def slow_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tokenizer(tmp_path_factory.mktemp("tok-slow"), SLOW_TEMPLATE)


@contextlib.contextmanager
def genrm_gateway(registry: gs.Registry, model_path: str, **options: Any) -> Iterator[Any]:
    """The genrm gateway over ``registry`` (model ``judge`` rendered with ``model_path``);
    yields ``(url, handler)``."""
    app = gateway_app(
        "genrm",
        registry,
        plugin_manager=PluginManager.create(),
        options=GatewayOptions(model_paths={"judge": model_path}, snapshot_ttl=0.0, **options),
    )
    with serve_app(app) as url:
        yield url, app.state.handler


def judge_registry(*urls: str, state: str = "READY") -> gs.Registry:
    return gs.Registry(gs.snapshot("genrm", {"judge": {"urls": list(urls), "state": state}}))


def wait_ready(url: str) -> None:
    wait_for(
        lambda: gs.get(f"{url}/genrm/health?schema=2")[0] == 200, timeout=60, what="genrm ready"
    )


def timed(fn: Any) -> tuple[float, Any]:
    begin = time.perf_counter()
    out = fn()
    return time.perf_counter() - begin, out


def test_tokenizers_load_at_gateway_start_and_health_waits_for_them(fast_tokenizer: str) -> None:
    with (
        gs.upstream("judge") as engine,
        genrm_gateway(judge_registry(engine.url), fast_tokenizer) as (url, handler),
    ):
        wait_ready(url)
        status, _, body = gs.get(f"{url}/genrm/health?schema=2")
        assert status == 200 and json.loads(body)["adapter"] == "ok"
        # Loaded before any request asked for it.
        assert len(handler.adapter.tokenizers) == 1 and engine.stats()["requests"] == 0


def test_a_render_does_not_delay_a_teacher_request_or_a_raw_request_of_the_same_gateway(
    slow_tokenizer: str,
) -> None:
    with gs.upstream("judge") as judge, gs.upstream("teacher") as teacher:
        teacher_registry = gs.Registry(gs.snapshot("teacher", {"math": {"urls": [teacher.url]}}))
        pm = PluginManager.create()
        with (
            genrm_gateway(judge_registry(judge.url), slow_tokenizer) as (url, _),
            gs.gateway("teacher", teacher_registry, plugin_manager=pm) as teacher_url,
        ):
            wait_ready(url)  # the warm-up render at start is done
            rendered: dict[str, Any] = {}

            def judge_once() -> None:
                rendered["latency"], rendered["answer"] = timed(
                    lambda: gs.post(f"{url}/genrm/generate", {"messages": MESSAGES})
                )

            thread = threading.Thread(target=judge_once)
            thread.start()
            teacher_latencies, raw_latencies = [], []
            raw = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            while thread.is_alive():
                took, (status, _, _) = timed(
                    lambda: gs.post(f"{teacher_url}/teacher/generate", {"text": "x"})
                )
                assert status == 200
                teacher_latencies.append(took)
                took, (status, _, _) = timed(lambda: gs.post(f"{url}/genrm/generate", raw))
                assert status == 200
                raw_latencies.append(took)
            thread.join()
    status, _, body = rendered["answer"]
    assert status == 200 and "response" in json.loads(body)
    render = rendered["latency"]
    # Both were answered many times over while the render ran, each in a small fraction of it.
    assert len(teacher_latencies) >= 3, (render, teacher_latencies)
    assert max(teacher_latencies) < render / 10, (render, teacher_latencies)
    assert max(raw_latencies) < render / 10, (render, raw_latencies)
    print(
        f"render {render:.2f}s; during it: teacher max {max(teacher_latencies) * 1000:.0f} ms, "
        f"raw genrm max {max(raw_latencies) * 1000:.0f} ms ({len(teacher_latencies)} each)"
    )


def test_a_replica_that_went_away_during_the_render_is_not_sent_the_request(
    slow_tokenizer: str,
) -> None:
    with gs.upstream("a") as a, gs.upstream("b") as b:
        registry = judge_registry(a.url)
        with genrm_gateway(registry, slow_tokenizer) as (url, _):
            wait_ready(url)
            registry.calls = 0
            answer: dict[str, Any] = {}
            thread = threading.Thread(
                target=lambda: answer.update(
                    r=gs.post(f"{url}/genrm/generate", {"messages": MESSAGES})
                )
            )
            thread.start()
            # While it renders for replica a, a fails and b comes up.
            wait_for(lambda: registry.calls >= 1, timeout=10, what="the request routed to a")
            failed = gs.snapshot("genrm", {"judge": {"urls": [b.url]}}).to_json()
            head_a = dict(failed["models"]["judge"]["engines"][0])
            head_a.update(
                engine_id="judge/replica-9", base_url=None, state="FAILED", direct_eligible=False
            )
            failed["models"]["judge"]["engines"].append(head_a)
            registry.value = type(registry.value).from_json(failed)
            thread.join(60)
        status, _, body = answer["r"]
        assert status == 200 and json.loads(body)["response"].startswith("b:")
        assert a.stats()["requests"] == 0 and b.stats()["requests"] == 1


def _judge(url: str, messages: Any = MESSAGES, **kwargs: Any) -> str:
    async def go() -> str:
        async with JudgeClient(url, **{k: v for k, v in kwargs.items() if k == "token"}) as c:
            return await c.judge(messages, **{k: v for k, v in kwargs.items() if k != "token"})

    return asyncio.run(go())


def test_the_judge_client_reads_the_gateways_errors_and_keeps_their_status(
    fast_tokenizer: str,
) -> None:
    with gs.upstream("yes") as engine:
        registry = judge_registry(engine.url)
        with genrm_gateway(registry, fast_tokenizer, token="s3cret") as (url, _):
            wait_ready(url)

            async def score() -> float:
                async with JudgeClient(url, token="s3cret") as client:
                    sample = {"prompt": "2+2?", "response": "4", "label": "4"}
                    return await judge_sample(sample, client=client)

            assert asyncio.run(score()) == 1.0  # the engine's text starts with "yes"
            sent = engine.last()["body"]
            assert isinstance(sent["input_ids"], list) and "messages" not in sent

            cases = {
                "bad conversation": ({"messages": [{"role": "", "content": "x"}]}, 400),
                "unknown model": ({"model": "missing"}, 400),
                "no token": ({"token": None}, 401),
            }
            for what, (kwargs, status) in cases.items():
                messages = kwargs.pop("messages", MESSAGES)
                token = kwargs.pop("token", "s3cret")
                with pytest.raises(UpstreamStatusError) as info:
                    _judge(url, messages, token=token, **kwargs)
                assert info.value.status == status, what
                gateway_message = json.loads(info.value.body)["error"]["message"]
                assert gateway_message in info.value.message, what

            registry.value = judge_registry(engine.url, state="SLEEPING").value
            with pytest.raises(UpstreamStatusError) as info:
                _judge(url, token="s3cret")
            assert info.value.status == 503 and info.value.retry_after == 5.0
            assert "SLEEPING" in info.value.message

            registry.value = judge_registry(engine.url).value
            engine.kill()
            with pytest.raises(UpstreamStatusError) as info:
                _judge(url, token="s3cret")
            assert info.value.status == 502 and "could not be reached" in info.value.message
