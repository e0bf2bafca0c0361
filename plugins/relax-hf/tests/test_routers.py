"""The real sglang-router (0.3.2) and smg (1.13) register an hf engine and route to it."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from relax_hf.testing import EngineServer, Http

from relax_core import SubprocessEngineProcess
from relax_core.testing import free_port

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _argv(kind: str, port: int, worker: str, prometheus_port: int) -> list[str]:
    common = [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker,
        "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
    ]  # fmt: skip
    if kind == "sglang-router":
        return [sys.executable, "-m", "sglang_router.launch_router", *common]
    # `python -m smg`: sglang-router installs a console script of the same name over smg's.
    return [sys.executable, "-m", "smg", "launch", *common]


@pytest.fixture(scope="module", params=["sglang-router", "smg"])
def router(
    request: pytest.FixtureRequest,
    shared_server: EngineServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Http]:
    """A router process in front of the shared hf engine, up and routing; killed afterwards."""
    kind = request.param
    port = free_port()
    proc = SubprocessEngineProcess.start(
        _argv(kind, port, shared_server.url, free_port()),
        base_url=f"http://127.0.0.1:{port}",
        engine_id=kind,
        # The routers try to fetch a tokenizer for the model from a hub and only warn.
        env={"HF_HUB_OFFLINE": "1", "RUST_LOG": "warn"},
        log_path=str(tmp_path_factory.mktemp(kind) / "router.log"),
    )
    try:
        proc.wait_ready(60)
        http = Http(proc.base_url or "")
        deadline = time.monotonic() + 60
        # Registration is asynchronous: wait until the worker is routable.
        while (
            http.post(
                "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}, timeout=10
            )[0]
            != 200
        ):
            assert time.monotonic() < deadline, (
                f"{kind} never routed to the engine:\n{proc.log_tail()}"
            )
            assert proc.poll() is None, f"{kind} exited:\n{proc.log_tail()}"
            time.sleep(0.2)
        yield http
    finally:
        proc.terminate(10)


def test_router_routes_generate_to_the_hf_engine(router: Http, shared_server: EngineServer) -> None:
    direct = shared_server.http.generate("Hello router", sampling_params=GREEDY)
    status, routed = router.post("/generate", {"text": "Hello router", "sampling_params": GREEDY})
    assert status == 200
    assert routed["output_ids"] == direct["output_ids"] and routed["text"] == direct["text"]


def test_router_routes_chat_completions(router: Http, shared_server: EngineServer) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    direct = shared_server.http.ok("/v1/chat/completions", body)
    status, routed = router.post("/v1/chat/completions", body)
    assert status == 200, routed
    assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert routed["usage"]["completion_tokens"] == 5


def test_router_streams_generate_events(router: Http) -> None:
    events = router.stream("/generate", {"text": "Hi", "stream": True, "sampling_params": GREEDY})
    assert events[-1] == b"data: [DONE]\n\n"
    last = json.loads(events[-2][len(b"data: ") : -2])
    assert last["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_teacher_fields_survive_the_router(router: Http, shared_server: EngineServer) -> None:
    body = {
        "input_ids": [10, 20, 30, 40, 50],
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 3,
        "token_ids_logprob": [7, 8],
        "rid": "through-the-router",
    }
    direct = shared_server.http.ok("/generate", {**body, "rid": "direct"})
    status, routed = router.post("/generate", body)
    assert status == 200, routed
    meta = routed["meta_info"]
    assert meta["id"] == "through-the-router"
    assert len(meta["input_token_logprobs"]) == 3
    mine, theirs = meta["input_token_logprobs"], direct["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in mine] == [e[1] for e in theirs] and mine[0][0] is theirs[0][0] is None
    # The second of the two reuses the first's prefix from the prefix cache: equal to rounding.
    assert [e[0] for e in mine[1:]] == pytest.approx([e[0] for e in theirs[1:]], abs=1e-5)
    assert len(meta["input_top_logprobs"][1]) == 3
    assert [e[1] for e in meta["input_token_ids_logprobs"][1]] == [7, 8]
