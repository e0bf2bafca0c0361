"""The engine on CUDA (CUDA graphs, the KV cache pool) against the same engine on CPU.

Skipped without a CUDA device; the GPU benchmark (``relax-hf gpu-bench``) runs on the same
machine kind and its numbers are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from relax_hf.testing import EngineServer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["Once upon a time", "Question: what is two plus two?", "def add(a, b):"]


@pytest.fixture(scope="module")
def pair(start_server: Any) -> tuple[EngineServer, EngineServer]:
    cpu = start_server("hf-cpu")
    cuda = start_server(
        "hf-cuda",
        device="cuda",
        extra_args=("--mem-fraction-static", "0.3", "--constrained-json-max-whitespace-cnt", "1"),
    )
    return cpu, cuda


def _outputs(server: EngineServer, **sp: Any) -> list[list[int]]:
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **sp}}
    return [o["output_ids"] for o in server.http.ok("/generate", body)]


def test_greedy_and_seeded_outputs_on_cuda_equal_the_cpu_engines(
    pair: tuple[EngineServer, EngineServer],
) -> None:
    cpu, cuda = pair
    assert _outputs(cuda, temperature=0.0) == _outputs(cpu, temperature=0.0)
    seeded = {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 9, "n": 2}
    assert _outputs(cuda, **seeded) == _outputs(cpu, **seeded)
    graphs = cuda.http.ok("/server_info")["memory"]["cuda_graphs"]
    assert graphs["enabled"] and graphs["captured"] > 0 and graphs["replays"] > 0


def test_the_cuda_graph_and_kv_cache_tags_release_and_restore(
    pair: tuple[EngineServer, EngineServer],
) -> None:
    _, cuda = pair
    before = _outputs(cuda, temperature=0.0)
    info = cuda.http.ok("/server_info")["memory"]
    cuda.http.ok("/release_memory_occupation", {"tags": ["cuda_graph", "kv_cache"]})
    released = cuda.http.ok("/server_info")["memory"]
    assert released["cuda_graphs"]["captured"] == 0
    assert released["kv_cache"]["resident"] is False
    freed = info["cuda_memory_reserved"] - released["cuda_memory_reserved"]
    assert freed >= info["kv_cache"]["pool_bytes"]
    cuda.http.ok("/resume_memory_occupation", {"tags": ["cuda_graph", "kv_cache"]})
    resumed = cuda.http.ok("/server_info")["memory"]
    assert resumed["cuda_graphs"]["captured"] == info["cuda_graphs"]["captured"]
    assert _outputs(cuda, temperature=0.0) == before


def test_a_json_schema_constrains_output_on_cuda(pair: tuple[EngineServer, EngineServer]) -> None:
    _, cuda = pair
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    body = {
        "text": "JSON:",
        "sampling_params": {
            "max_new_tokens": 64,
            "json_schema": json.dumps(schema),
            "sampling_seed": 2,
        },
    }
    out = cuda.http.ok("/generate", body)
    assert set(json.loads(out["text"], strict=False)) == {"ok", "n"}
