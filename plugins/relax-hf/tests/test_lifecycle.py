"""Memory release/resume, pause/continue, abort and flush on real hf engines."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from relax_hf.testing import EngineServer

from relax_core.testing import wait_for

LONG = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}
PROBE = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


@pytest.fixture(scope="module")
def plain(start_server: Any) -> EngineServer:
    """An engine without a CPU backup: released weights are reloaded from the checkpoint."""
    return start_server("hf-plain")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def backed(start_server: Any) -> EngineServer:
    """An engine that keeps released weights in host memory."""
    return start_server("hf-backup", weights_cpu_backup=True)  # type: ignore[no-any-return]


def _info(server: EngineServer) -> dict[str, Any]:
    return server.http.ok("/server_info")  # type: ignore[no-any-return]


def _start_long(server: EngineServer, pool: ThreadPoolExecutor, rid: str) -> Future[dict[str, Any]]:
    fut = pool.submit(server.http.generate, "Tell me a long story", sampling_params=LONG, rid=rid)
    wait_for(
        lambda: _info(server)["num_running_reqs"] >= 1, timeout=30, what="the long request to run"
    )
    return fut


@pytest.mark.parametrize("which", ["plain", "backed"])
def test_release_answers_503_and_resume_restores_the_same_outputs(
    which: str, request: pytest.FixtureRequest
) -> None:
    server: EngineServer = request.getfixturevalue(which)
    before = server.http.generate("The sea is", sampling_params=PROBE)
    out = server.http.ok("/release_memory_occupation", {"tags": None})
    assert out["success"] is True and sorted(out["tags"]) == ["cuda_graph", "kv_cache", "weights"]
    status, body, headers = server.http.request("POST", "/generate", {"text": "x"})
    assert status == 503 and headers.get("retry-after") == "1"
    assert "resume_memory_occupation" in body["error"]["message"]
    assert (
        server.http.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})[
            0
        ]
        == 503
    )
    assert server.http.get("/health_generate")[0] == 503
    assert server.http.get("/health")[0] == 200  # the process is up
    info = _info(server)
    assert info["resident"] == {"weights": False, "kv_cache": False, "cuda_graph": False}
    resumed = server.http.ok("/resume_memory_occupation", {"tags": None})
    # Without a backup nothing is read back at the resume: the first request below reads the
    # checkpoint (the weights were the checkpoint's when discarded).
    assert resumed["detail"]["weights"]["source"] == (
        "cpu_backup" if which == "backed" else "discarded"
    )
    after = server.http.generate("The sea is", sampling_params=PROBE)
    assert after["output_ids"] == before["output_ids"]
    assert server.http.get("/health_generate")[0] == 200


def test_released_weights_without_backup_leave_the_device(plain: EngineServer) -> None:
    # Measured by the server: parameter storages it still holds on its device, whether the
    # released storage objects are really gone (weak references), and its RSS.
    before = _info(plain)["memory"]
    param_bytes = before["param_bytes"]
    assert before["resident_param_bytes"] == param_bytes > 8 * 2**20
    plain.http.ok("/release_memory_occupation", {"tags": ["weights"]})
    after = _info(plain)["memory"]
    assert after["resident_param_bytes"] == 0
    assert after["released_storages_alive"] == 0
    assert after["cpu_backup_bytes"] == 0
    assert before["process_rss_bytes"] - after["process_rss_bytes"] >= 0.6 * param_bytes
    plain.http.ok("/resume_memory_occupation", {"tags": ["weights"]})
    again = _info(plain)["memory"]
    assert again["resident_param_bytes"] == param_bytes
    # Discarded: nothing read back yet; the first request reads the checkpoint's bytes in.
    assert again["weights_pending"] > 0
    plain.http.ok("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}})
    read = _info(plain)["memory"]
    assert read["weights_pending"] == 0
    assert read["process_rss_bytes"] - after["process_rss_bytes"] >= 0.6 * param_bytes


def test_backup_is_a_host_copy_of_every_weight(backed: EngineServer) -> None:
    mem = _info(backed)["memory"]
    assert mem["cpu_backup_bytes"] == mem["param_bytes"]
    backed.http.ok("/release_memory_occupation", {"tags": ["weights"]})
    assert _info(backed)["memory"]["resident_param_bytes"] == 0
    backed.http.ok("/resume_memory_occupation", {"tags": ["weights"]})
    assert _info(backed)["memory"]["resident_param_bytes"] == mem["param_bytes"]


def test_release_is_idempotent_and_partial_tags_block_generation(plain: EngineServer) -> None:
    plain.http.ok("/release_memory_occupation", {"tags": ["kv_cache"]})
    plain.http.ok("/release_memory_occupation", {"tags": ["kv_cache"]})
    assert _info(plain)["resident"] == {"weights": True, "kv_cache": False, "cuda_graph": True}
    assert plain.http.post("/generate", {"text": "x"})[0] == 503
    plain.http.ok("/resume_memory_occupation", {"tags": ["kv_cache"]})
    plain.http.ok("/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert (
        plain.http.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}})[0]
        == 200
    )


def test_release_is_refused_while_a_request_runs(
    plain: EngineServer, pool: ThreadPoolExecutor
) -> None:
    fut = _start_long(plain, pool, "long-release")
    status, body = plain.http.post("/release_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "pause_generation" in body["message"]
    plain.http.ok("/abort_request", {"rid": "long-release"})
    assert fut.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
    assert _info(plain)["resident"]["weights"] is True


def test_a_release_of_every_tag_refused_while_busy_changes_nothing(
    plain: EngineServer, pool: ThreadPoolExecutor
) -> None:
    # What lets the manager release without a flush_cache first: the refusal leaves every tag
    # resident and the request running.
    fut = _start_long(plain, pool, "long-release-all")
    status, body = plain.http.post("/release_memory_occupation", {"tags": None})
    assert status == 400 and "in flight" in body["message"]
    assert all(_info(plain)["resident"].values())
    plain.http.ok("/abort_request", {"rid": "long-release-all"})
    fut.result(timeout=30)


def test_a_resume_asked_to_check_a_generation_generates_one_token(plain: EngineServer) -> None:
    plain.http.ok("/release_memory_occupation", {"tags": None})
    out = plain.http.ok("/resume_memory_occupation", {"tags": None, "check_generation": True})
    assert out["generation_checked"] is True and all(_info(plain)["resident"].values())
    assert "generation_checked" not in plain.http.ok("/resume_memory_occupation", {"tags": None})
    status, body = plain.http.post(
        "/resume_memory_occupation", {"tags": None, "check_generation": "yes"}
    )
    assert status == 400 and "check_generation" in json.dumps(body)
    # Paused, the check cannot generate: 503, the tags resumed all the same.
    plain.http.ok("/pause_generation", {"mode": "in_place"})
    try:
        plain.http.ok("/release_memory_occupation", {"tags": ["kv_cache"]})
        status, body = plain.http.post(
            "/resume_memory_occupation", {"tags": ["kv_cache"], "check_generation": True}
        )
        assert status == 503 and "paused" in json.dumps(body)
        assert _info(plain)["resident"]["kv_cache"] is True
    finally:
        plain.http.ok("/continue_generation", {})
    assert plain.http.get("/health_generate")[0] == 200


def test_abort_cancels_an_in_flight_request(plain: EngineServer, pool: ThreadPoolExecutor) -> None:
    fut = _start_long(plain, pool, "long-abort")
    out = plain.http.ok("/abort_request", {"rid": "long-abort"})
    assert out["found"] is True
    result = fut.result(timeout=30)
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort by user request"}
    assert 0 < meta["completion_tokens"] < LONG["max_new_tokens"]
    assert len(result["output_ids"]) == meta["completion_tokens"]
    assert plain.http.ok("/abort_request", {"rid": "long-abort"})["found"] is False


def test_flush_cache_answers_400_while_busy(plain: EngineServer, pool: ThreadPoolExecutor) -> None:
    fut = _start_long(plain, pool, "long-flush")
    status, body = plain.http.post("/flush_cache")
    assert status == 400 and "pending or running" in body["message"]
    plain.http.ok("/abort_request", {"abort_all": True})
    fut.result(timeout=30)
    assert plain.http.post("/flush_cache")[0] == 200
    assert plain.http.get("/flush_cache")[0] == 200


def test_pause_in_place_holds_requests_until_continue(
    plain: EngineServer, pool: ThreadPoolExecutor
) -> None:
    plain.http.ok("/pause_generation", {"mode": "in_place"})
    try:
        fut = pool.submit(plain.http.generate, "held", sampling_params=PROBE)
        wait_for(
            lambda: _info(plain)["num_waiting_reqs"] == 1, timeout=30, what="the request to queue"
        )
        assert not fut.done()
        assert plain.http.get("/health_generate")[0] == 503
    finally:
        plain.http.ok("/continue_generation", {})
    assert fut.result(timeout=30)["meta_info"]["completion_tokens"] == PROBE["max_new_tokens"]


def test_pause_abort_aborts_what_is_in_flight(
    plain: EngineServer, pool: ThreadPoolExecutor
) -> None:
    fut = _start_long(plain, pool, "long-pause")
    out = plain.http.ok("/pause_generation", {"mode": "abort"})
    assert "1 request(s) aborted" in out["message"]
    assert fut.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
    plain.http.ok("/continue_generation", {})
    assert plain.http.generate("x", sampling_params=PROBE)["meta_info"]["completion_tokens"] == 10


def test_a_stream_whose_client_goes_away_is_aborted(plain: EngineServer) -> None:
    host, port = plain.url.removeprefix("http://").split(":")
    body = json.dumps({"text": "stream", "stream": True, "sampling_params": LONG}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        seen = b""
        while b"data: " not in seen:  # headers first, then the first event
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream early"
            seen += chunk
        assert _info(plain)["num_running_reqs"] == 1
    wait_for(
        lambda: _info(plain)["num_running_reqs"] == 0,
        timeout=30,
        what="the abandoned stream to be aborted",
    )


def test_engine_throughput_counts_every_new_token_of_its_requests(plain: EngineServer) -> None:
    import asyncio

    from relax_hf.throughput_bench import format_result, measure

    vocab = int(_info(plain).get("vocab_size") or 0) or 64
    out = asyncio.run(
        measure(
            plain.url, concurrency=3, requests=5, prompt_tokens=7, max_new_tokens=4,
            temperature=1.0, vocab=min(vocab, 64),
        )
    )  # fmt: skip
    assert (out["requests"], out["output_tokens"]) == (5, 20) and out["tokens_per_s"] > 0
    out["device"] = "cpu"
    assert "5 requests, 3 in flight, 7 prompt + 4 new tokens: 20 tokens" in format_result(out)


def test_engine_throughput_variants_send_the_phases_requests(plain: EngineServer) -> None:
    import asyncio

    from relax_hf.throughput_bench import measure

    shape = {"concurrency": 4, "requests": 4, "prompt_tokens": 60, "max_new_tokens": 3}

    def run(variant: str, **kw: Any) -> dict[str, Any]:
        options = {**shape, **kw}
        out = measure(plain.url, temperature=1.0, vocab=64, variant=variant, samples=2, **options)
        return asyncio.run(out)

    for variant in ("shared-prefix", "rollout"):
        out = run(variant)
        assert (out["requests"], out["output_tokens"]) == (4, 12), variant
        assert out["mean_prompt_tokens"] == 60 and out["engine_steps"] > 0
    # Rendered by the engine's chat template (the system prompt alone is ~100 tiny tokens).
    chat = run("chat", prompt_tokens=200)
    assert chat["output_tokens"] == 12 and 170 <= chat["mean_prompt_tokens"] <= 230


def test_engine_throughput_refuses_an_unknown_variant_before_starting_an_engine(
    tmp_path: Path,
) -> None:
    from relax_hf.throughput_bench import run

    with pytest.raises(ValueError, match="each variant is one of"):
        run(str(tmp_path), device="cpu", compare=["shared-prefix", "bogus"])
    with pytest.raises(ValueError, match="rounds=0"):
        run(str(tmp_path), device="cpu", rounds=0)


def test_the_engine_keeps_its_start_up_objects_out_of_full_collections(
    plain: EngineServer,
) -> None:
    gc_info = _info(plain)["gc"]
    assert gc_info["frozen_objects"] > 100_000  # torch, transformers, the model, the tokenizer
    assert len(gc_info["collections"]) == 3


def test_a_release_frees_weights_that_a_frozen_reference_cycle_held(tiny_model: Path) -> None:
    # In this process: the start-up heap frozen (as the engine does once started) with a
    # reference cycle in it that holds a view of the weights. The release's collection of the
    # young objects cannot free them; it must look at the frozen heap too.
    import gc

    from relax_hf.runner import ModelRunner

    runner = ModelRunner(str(tiny_model), max_total_tokens=256)

    class Holder:
        pass

    holder = Holder()
    holder.cycle = holder  # type: ignore[attr-defined]
    holder.view = runner._flat[:16]  # type: ignore[attr-defined,index]
    try:
        assert ModelRunner.freeze_heap() > 0
        del holder  # garbage now, in the frozen heap
        runner.release_weights()
        assert runner.memory_report()["released_storages_alive"] == 0
        assert gc.get_freeze_count() > 0  # frozen again after looking
    finally:
        gc.unfreeze()
