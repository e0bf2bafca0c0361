"""The preallocated KV cache pool: sized at start, held, released and restored with its tag."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from relax_hf.plugin import launch
from relax_hf.testing import EngineServer

from relax_core import EngineLaunchSpec, EngineOptions

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def small(start_server: Any) -> EngineServer:
    """An engine whose pool holds 64 tokens."""
    return start_server("hf-small-pool", extra_args=("--max-total-tokens", "64"))  # type: ignore[no-any-return]


def test_max_total_tokens_sizes_the_pool(small: EngineServer) -> None:
    info = small.http.ok("/server_info")
    assert info["max_total_num_tokens"] == 64
    kv = info["memory"]["kv_cache"]
    assert kv["resident"] and kv["num_slots"] == 65  # and the scratch slot
    assert kv["pool_bytes"] == 65 * kv["bytes_per_token"] and kv["free_slots"] == 64


def test_a_request_that_can_never_fit_the_pool_is_refused(small: EngineServer) -> None:
    status, out = small.http.post(
        "/generate", {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 60}}
    )
    assert status == 400 and "sampling_params.max_new_tokens" in out["error"]["message"]
    assert "--max-total-tokens" in out["error"]["message"]


def test_requests_wait_for_slots_instead_of_failing(small: EngineServer) -> None:
    # Each needs 10 + 30 slots: the second waits until the first has given its slots back.
    body = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 30, **GREEDY}}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: small.http.ok("/generate", body), range(2)))
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [30, 30]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    info = small.http.ok("/server_info")
    kv = info["memory"]["kv_cache"]
    # Every slot is free again, or held by the prefix cache (which gives it up on demand).
    assert info["peak_running_reqs"] == 1 and kv["free_slots"] + kv["prefix_cache_slots"] == 64


def test_releasing_kv_cache_drops_the_pool_and_resume_restores_it(
    small: EngineServer,
) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    before = small.http.ok("/generate", body)["output_ids"]
    small.http.ok("/release_memory_occupation", {"tags": ["kv_cache"]})
    kv = small.http.ok("/server_info")["memory"]["kv_cache"]
    assert kv["resident"] is False and kv["bytes"] == 0
    assert small.http.post("/generate", body)[0] == 503
    small.http.ok("/resume_memory_occupation", {"tags": ["kv_cache"]})
    kv = small.http.ok("/server_info")["memory"]["kv_cache"]
    assert kv["resident"] and kv["free_slots"] == 64
    assert small.http.ok("/generate", body)["output_ids"] == before


def test_mem_fraction_static_takes_that_share_of_memory(tiny_model: Path, tmp_path: Path) -> None:
    proc = launch(
        EngineLaunchSpec(
            engine_id="hf-fraction",
            model_path=str(tiny_model),
            log_path=str(tmp_path / "engine.log"),
            options=EngineOptions(
                extra_args=("--mem-fraction-static", "0.02"), env={"OMP_NUM_THREADS": "1"}
            ),
        )
    )
    try:
        proc.wait_ready(120)
        server = EngineServer(proc)
        info = server.http.ok("/server_info")
        mem = info["memory"]
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU: physical RAM
        budget = int(total * 0.02) - mem["param_bytes"]
        kv = mem["kv_cache"]
        assert kv["num_slots"] == budget // kv["bytes_per_token"]
        assert kv["mem_fraction_static"] == 0.02
    finally:
        proc.terminate(10)


def test_a_fraction_too_small_for_any_pool_fails_at_start_naming_the_flag(
    tiny_model: Path, tmp_path: Path
) -> None:
    proc = launch(
        EngineLaunchSpec(
            engine_id="hf-no-room",
            model_path=str(tiny_model),
            log_path=str(tmp_path / "engine.log"),
            options=EngineOptions(
                extra_args=("--mem-fraction-static", "0.0000001"), env={"OMP_NUM_THREADS": "1"}
            ),
        )
    )
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the engine did not fail"
            time.sleep(0.1)
        assert proc.poll() != 0
        assert "--mem-fraction-static" in proc.log_tail()
    finally:
        proc.terminate(5)
