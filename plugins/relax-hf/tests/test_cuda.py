"""The engine on CUDA (CUDA graphs, the KV cache pool, the prefix cache) against the same
engine on CPU.

Skipped without a CUDA device; the GPU benchmark (``relax-hf gpu-bench``) runs on the same
machine kind and its numbers are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from relax_hf.testing import EngineServer
from relax_hf.tiny import make_tiny_model

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
    info = cuda.http.ok("/server_info")
    graphs = info["memory"]["cuda_graphs"]
    assert graphs["enabled"] and graphs["captured"] > 0 and graphs["replays"] > 0
    assert info["attention_backend"] == "triton"  # CUDA's default: the pool read in place


def test_the_gather_path_on_cuda_draws_what_the_triton_kernel_draws(
    pair: tuple[EngineServer, EngineServer], second_engine: Callable[..., EngineServer]
) -> None:
    # The pair's CUDA engine decodes through the Triton kernel; one started with
    # --attention-backend torch_native gathers and runs SDPA: the same tokens, log-probs close.
    _, cuda = pair
    native = second_engine("hf-cuda-native", "--attention-backend", "torch_native")
    assert native.http.ok("/server_info")["attention_backend"] == "torch_native"
    for sp in ({"temperature": 0.0}, {"temperature": 0.8, "sampling_seed": 5, "n": 2}):
        got, want = _with_logprobs(cuda, **sp), _with_logprobs(native, **sp)
        for (ids, lp), (ref_ids, ref) in zip(got, want, strict=True):
            assert ids == ref_ids
            assert lp == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_decode_kernel_matches_the_gather_path_eagerly_and_in_a_graph(
    dtype: torch.dtype,
) -> None:
    """The compiled kernels (test_paged_attention.py runs them in Triton's interpreter, not in
    bfloat16) against gather + SDPA in float32: ragged rows over scattered slots at the judge's
    heads, for several rows x buckets; then one captured graph replayed after its rows' lengths
    and slots changed, as a decode graph replays."""
    from relax_hf.paged_attention import decode_attention
    from relax_hf.testing import gathered_decode_attention as reference

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, hkv, d, slots = 16, 8, 128, 300_000
    cache = torch.randn(slots, 2, hkv, d, device="cuda", generator=g).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows, ctx in ((1, 128), (7, 256), (64, 512), (256, 512), (3, 2048)):
        q = torch.randn(rows, heads + 2 * hkv, d, device="cuda", generator=g).to(dtype)[:, :heads]
        table = torch.randperm(slots, device="cuda", generator=g)[: rows * ctx].view(rows, ctx)
        pos = torch.randint(0, ctx, (rows,), device="cuda", generator=g)
        pos[0], pos[-1] = 0, ctx - 1
        out = decode_attention(q, cache, table, pos, d**-0.5)
        want = reference(q, cache, table, pos)
        torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)

    rows, ctx = 32, 512
    q = torch.randn(rows, heads, d, device="cuda", generator=g).to(dtype)
    table = torch.randperm(slots, device="cuda", generator=g)[: rows * ctx].view(rows, ctx)
    pos = torch.full((rows,), 5, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, cache, table, pos, d**-0.5)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, cache, table, pos, d**-0.5)
    pos.copy_(torch.randint(0, ctx, (rows,), device="cuda", generator=g))
    table.copy_(torch.randperm(slots, device="cuda", generator=g)[: rows * ctx].view(rows, ctx))
    graph.replay()
    torch.testing.assert_close(
        out.float(), reference(q, cache, table, pos), rtol=tolerance, atol=tolerance
    )


def test_prompts_after_a_cached_template_replay_a_prefill_graph_with_the_cpu_answer(
    pair: tuple[EngineServer, EngineServer],
) -> None:
    """A judge-shaped prefill (a few prompts after a template the prefix cache holds) replays a
    captured prefill step on CUDA and draws what the CPU engine's eager prefill draws."""
    cpu, cuda = pair
    template = "You are a strict judge. Score the answer below from 0 to 9. " * 3
    answers = [template + "Answer: " + a for a in ("four", "22 / 7", "def add(a, b): return a")]

    def judge(server: EngineServer) -> tuple[list[list[int]], list[int]]:
        server.http.ok("/generate", {"text": template, "sampling_params": {"max_new_tokens": 1}})
        sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        out = server.http.ok("/generate", {"text": answers, "sampling_params": sp})
        return [o["output_ids"] for o in out], [o["meta_info"]["cached_tokens"] for o in out]

    graphs = cuda.http.ok("/server_info")["memory"]["cuda_graphs"]
    assert graphs["prefill_captured"] > 0
    got, cached = judge(cuda)
    assert min(cached) > 0
    after = cuda.http.ok("/server_info")["memory"]["cuda_graphs"]
    assert after["prefill_replays"] > graphs["prefill_replays"]
    assert got == judge(cpu)[0]


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
    pytest.importorskip("xgrammar", reason="constrained decoding needs relax-hf[grammar]")
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


# Longer than the decode contexts captured at start (<= 256): the graphs of longer contexts
# are captured on first use, and they read the cached prefix's slots too.
LONG = [(7 * i + 3) % 400 + 10 for i in range(600)]


def _greedy(server: EngineServer, tail: list[int]) -> dict[str, Any]:
    body = {
        "input_ids": [*LONG, *tail],
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    }
    return server.http.ok("/generate", body)  # type: ignore[no-any-return]


@pytest.fixture
def other_model(tmp_path: Path) -> Path:
    """The tiny architecture with other random weights (seed 1)."""
    return make_tiny_model(tmp_path / "tiny-seed-1", seed=1)


def test_a_cached_prefix_on_cuda_decodes_as_a_full_prefill_until_a_weight_update(
    pair: tuple[EngineServer, EngineServer], tiny_model: Path, other_model: Path
) -> None:
    cpu, cuda = pair
    cuda.http.ok("/flush_cache")
    assert _greedy(cuda, [1, 2])["meta_info"]["cached_tokens"] == 0
    hit = _greedy(cuda, [3, 4, 5])
    assert hit["meta_info"]["cached_tokens"] == len(LONG)
    cuda.http.ok("/flush_cache")  # the same prompt, prefilled whole on the GPU
    full = _greedy(cuda, [3, 4, 5])
    assert full["meta_info"]["cached_tokens"] == 0 and full["output_ids"] == hit["output_ids"]
    cpu.http.ok("/flush_cache")
    on_cpu = _greedy(cpu, [3, 4, 5])
    assert on_cpu["meta_info"]["cached_tokens"] == 0 and on_cpu["output_ids"] == hit["output_ids"]
    try:
        # K/V of other weights is never served, even when the update asks not to flush.
        cuda.http.ok(
            "/update_weights_from_disk",
            {"model_path": str(other_model), "weight_version": "other", "flush_cache": False},
        )
        after = _greedy(cuda, [3, 4, 5])
        assert after["meta_info"]["cached_tokens"] == 0
        assert after["meta_info"]["weight_version"] == "other"
        assert after["output_ids"] != hit["output_ids"]
        again = _greedy(cuda, [3, 4, 5])  # cached again, under the new weights
        assert again["meta_info"]["cached_tokens"] == len(LONG) + 2  # all but the last token
        assert again["output_ids"] == after["output_ids"]
    finally:
        cuda.http.ok("/update_weights_from_disk", {"model_path": str(tiny_model)})


def test_without_memory_handoff_the_engine_says_its_graphs_are_captured_again(
    pair: tuple[EngineServer, EngineServer],
) -> None:
    _, cuda = pair
    graphs = cuda.http.ok("/server_info")["memory"]["cuda_graphs"]
    assert graphs["kept_across_release"] is False
    assert "--memory-handoff" in graphs["note"]


def test_with_memory_handoff_a_switch_keeps_the_graphs_and_captures_nothing(
    second_engine: Callable[..., EngineServer],
) -> None:
    server = second_engine("hf-cuda-handoff", "--memory-handoff", weights_cpu_backup=True)
    before = _outputs(server, temperature=0.0)
    started = server.http.ok("/server_info")["memory"]["cuda_graphs"]
    assert started["kept_across_release"] and started["note"] is None
    assert started["captured"] > 0 and started["bytes"] > 0
    # Every tag, then (offload_weights = false) the KV cache and graph tags with the weights kept.
    for tags in (None, None, ["kv_cache", "cuda_graph"], ["kv_cache", "cuda_graph"]):
        server.http.ok("/release_memory_occupation", {"tags": tags})
        assert server.http.ok("/server_info")["memory"]["cuda_graphs"]["captured"] > 0
        server.http.ok("/resume_memory_occupation", {"tags": tags})
        assert _outputs(server, temperature=0.0) == before
    after = server.http.ok("/server_info")["memory"]["cuda_graphs"]
    assert after["captures"] == started["captures"]
    assert after["replays"] > started["replays"]


@pytest.fixture
def second_engine(start_server: Any) -> Iterator[Callable[..., EngineServer]]:
    """Start CUDA engines beside the pair's (a fifth of the device each, ``flags`` added),
    stopped when the test ends: the module's engines would otherwise hold the device together
    and leave a later test's engine too little of it."""
    started: list[EngineServer] = []

    def start(name: str, *flags: str, **spec: Any) -> EngineServer:
        server: EngineServer = start_server(
            name, device="cuda", extra_args=("--mem-fraction-static", "0.2", *flags), **spec
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.process.terminate(10)


def _with_logprobs(server: EngineServer, **sp: Any) -> list[tuple[list[int], list[float]]]:
    """Each prompt's output ids and their log-probs."""
    body = {
        "text": PROMPTS,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **sp},
    }
    outs = server.http.ok("/generate", body)
    return [
        (o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs
    ]


def test_the_overlapped_schedule_on_cuda_changes_no_token_or_log_prob(
    pair: tuple[EngineServer, EngineServer], second_engine: Callable[..., EngineServer]
) -> None:
    # The graphs' static logits and tokens are overwritten by the step started ahead: the
    # log-probs gathered before it, and every token, equal those of the steps one by one.
    _, cuda = pair
    apart = second_engine("hf-cuda-apart", "--disable-overlap-schedule")

    ahead = cuda.http.ok("/server_info")["decode_steps_ahead_total"]
    for sp in ({"temperature": 0.0}, {"temperature": 0.8, "sampling_seed": 5, "n": 2}):
        assert _with_logprobs(cuda, **sp) == _with_logprobs(apart, **sp)
    assert cuda.http.ok("/server_info")["decode_steps_ahead_total"] > ahead
    assert apart.http.ok("/server_info")["decode_steps_ahead_total"] == 0


def test_the_compiled_decode_step_on_cuda_draws_what_the_cpu_engine_draws(
    pair: tuple[EngineServer, EngineServer], second_engine: Callable[..., EngineServer]
) -> None:
    # --enable-torch-compile: inductor's fused kernels in the decode graphs (test_modeling.py
    # checks the tracing on CPU); greedy and seeded rows as the CPU engine draws them, and the
    # log-probs as the uncompiled CUDA engine reads them.
    cpu, cuda = pair
    compiled = second_engine("hf-cuda-compiled", "--enable-torch-compile")
    graphs = compiled.http.ok("/server_info")["memory"]["cuda_graphs"]
    assert graphs["torch_compile"] and graphs["captured"] > 0
    assert _outputs(compiled, temperature=0.0) == _outputs(cpu, temperature=0.0)
    # Without a filter the decode graph draws the row (the compiled Gumbel noise); with top_p
    # the full sampler does.
    for seeded in ({"temperature": 0.8, "sampling_seed": 9}, {"top_p": 0.95, "sampling_seed": 3}):
        assert _outputs(compiled, **seeded, n=2) == _outputs(cpu, **seeded, n=2)
    got, want = _with_logprobs(compiled, temperature=0.0), _with_logprobs(cuda, temperature=0.0)
    for (ids, lp), (ref_ids, ref) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert lp == pytest.approx(ref, abs=1e-4)
    assert compiled.http.ok("/server_info")["memory"]["cuda_graphs"]["replays"] > graphs["replays"]
