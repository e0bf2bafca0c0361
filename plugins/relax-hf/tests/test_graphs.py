"""Decode graphs kept across a release and a resume where the addresses are stable.

On CPU the engine's mappings keep their addresses, and ``--emulate-cuda-graph`` runs decode
steps through the graph machinery with eager stand-ins that refuse to replay once the memory
they recorded has moved: the bookkeeping a CUDA engine with ``--memory-handoff`` relies on,
tested without a GPU (the CUDA tests are in ``test_cuda.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from relax_hf.testing import EngineServer

PROMPTS = ["Once upon a time", "Question: what is two plus two?", "def add(a, b):"]


@pytest.fixture(scope="module")
def emulated(start_server: Any) -> EngineServer:
    return start_server(
        "hf-graphs",
        weights_cpu_backup=True,
        extra_args=("--emulate-cuda-graph", "--max-running-requests", "4"),
    )


def _greedy(server: EngineServer) -> list[list[int]]:
    sp = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    return [
        o["output_ids"]
        for o in server.http.ok("/generate", {"text": PROMPTS, "sampling_params": sp})
    ]


def _graphs(server: EngineServer) -> dict[str, Any]:
    return server.http.ok("/server_info")["memory"]["cuda_graphs"]  # type: ignore[no-any-return]


def test_a_release_and_resume_keep_the_decode_graphs_and_change_no_output(
    emulated: EngineServer,
) -> None:
    before = _greedy(emulated)
    started = _graphs(emulated)
    assert started["emulated"] and started["kept_across_release"] and started["note"] is None
    assert started["captured"] > 0 and started["replays"] > 0
    emulated.http.ok("/release_memory_occupation", {"tags": None})
    released = _graphs(emulated)
    assert released["captured"] == started["captured"]  # kept while released
    emulated.http.ok("/resume_memory_occupation", {"tags": None})
    assert _greedy(emulated) == before
    after = _graphs(emulated)
    assert after["captures"] == started["captures"]  # the switch captured nothing
    assert after["replays"] > started["replays"]


def test_a_sleep_that_keeps_the_weights_keeps_the_graphs_and_changes_no_output(
    emulated: EngineServer,
) -> None:
    # What a model with offload_weights = false does at each switch: the KV cache pool and the
    # graph tag go and come back, the weights stay.
    before = _greedy(emulated)
    started = _graphs(emulated)
    for _ in range(2):
        emulated.http.ok("/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        resident = emulated.http.ok("/server_info")["resident"]
        assert resident == {"weights": True, "kv_cache": False, "cuda_graph": False}
        assert _graphs(emulated)["captured"] == started["captured"]
        emulated.http.ok("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        assert _greedy(emulated) == before
    after = _graphs(emulated)
    assert after["captures"] == started["captures"] and after["replays"] > started["replays"]


def test_weights_loaded_at_new_addresses_capture_the_graphs_again(
    emulated: EngineServer, tiny_model: Path
) -> None:
    before = _greedy(emulated)
    started = _graphs(emulated)
    # Loaded beside the weights held now (a failed load must leave them as they were), so
    # at other addresses: graphs of the old ones would read freed memory.
    emulated.http.ok("/update_weights_from_disk", {"model_path": str(tiny_model)})
    assert _greedy(emulated) == before
    after = _graphs(emulated)
    assert after["captures"] > started["captures"]
    assert after["replays"] > started["replays"]


def test_an_engine_without_graphs_on_cpu_reports_none(shared_server: EngineServer) -> None:
    graphs = _graphs(shared_server)
    assert graphs["enabled"] is False and graphs["captures"] == 0 and graphs["note"] is None


def test_a_prompt_with_one_token_to_compute_runs_as_a_decode_row_with_the_same_answer(
    emulated: EngineServer, shared_server: EngineServer
) -> None:
    """A one-token prompt (the engine's own generation check), or one whose prefix cache holds
    all but its last token, runs through the decode graph instead of an eager prefill; its
    first token and that token's log-prob are the prefill's."""
    one = {
        "input_ids": [[7], [123]],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    replays = _graphs(emulated)["replays"]
    got = emulated.http.ok("/generate", one)
    assert _graphs(emulated)["replays"] == replays + 1  # both rows, one replay, no decode step
    want = shared_server.http.ok("/generate", one)  # no graphs: an eager prefill
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        (g_lp, g_id, _), (w_lp, w_id, _) = (
            g["meta_info"]["output_token_logprobs"][0],
            w["meta_info"]["output_token_logprobs"][0],
        )
        assert g_id == w_id and g_lp == pytest.approx(w_lp, abs=1e-4)
    # The same prompt again: its prefix cache holds all but the last token.
    again = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    first = emulated.http.ok("/generate", again)
    replays = _graphs(emulated)["replays"]
    second = emulated.http.ok("/generate", again)
    assert second["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1
    assert second["output_ids"] == first["output_ids"]
    assert second["output_ids"] == shared_server.http.ok("/generate", again)["output_ids"]
    steps = len(second["output_ids"]) - 1  # decode steps after the first token
    assert _graphs(emulated)["replays"] == replays + 1 + steps
    replays = _graphs(emulated)["replays"]
    assert emulated.http.get("/health_generate")[0] == 200
    assert _graphs(emulated)["replays"] == replays + 1  # the check too: one replay
