"""``relax-hf multinode-bench``: what mirroring costs a two-node replica, and how fast it fails.

One run, real engine processes, in turn:

1. a single-node engine (``cuda:0``): decode tokens/s at concurrency 1 and 16, seeded sampled
   outputs, a tensor update (``lm_head`` + ``embed_tokens`` as safetensors) and the outputs after;
2. a two-node replica (head on ``cuda:0``, follower on ``cuda:1``): the same, plus whether its
   outputs equal the single engine's before and after the update, a release/resume round trip,
   the node group's counters (``diverged_tokens`` must stay 0), how long the head takes to
   report a kill -9'd follower (``/health_generate`` non-200), and how long a follower takes to
   exit after its head is killed.

``--device cuda`` needs two GPUs and uses the ~1.14B-parameter random model of
:mod:`relax_hf.gpu_bench`; ``--device cpu`` runs the same steps on a tiny model, both nodes on
the CPU (a smoke test: the two processes share the cores, so its speeds mean little).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["format_result", "run"]

_TOKENS = 128


def _wait(predicate: Any, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not within {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - start


def run(*, device: str = "cuda", quick: bool = False) -> dict[str, Any]:
    """Run the measurement; returns a JSON-able dict (see the module docstring).

    :raises ValueError: ``device`` is ``cuda`` and fewer than two GPUs are visible.
    """
    import torch
    from relax_torch_weights import serialize_named_tensors

    from relax_core import (
        EngineLaunchSpec,
        EngineOptions,
        SubprocessEngineProcess,
        free_port,
    )
    from relax_hf.gpu_bench import SIZES, make_random_model
    from relax_hf.plugin import launch
    from relax_hf.testing import Http

    cuda = device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise ValueError(
            "--device cuda: needs two GPUs (the head on one, the follower on the other)"
        )
    devices = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    size = "1b" if cuda else "tiny"
    tokens = 32 if quick else _TOKENS
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0,
                                                  "ignore_eos": True}}  # fmt: skip
    out: dict[str, Any] = {"device": device, "size": size, "tokens_per_request": tokens}
    procs: list[SubprocessEngineProcess] = []

    with tempfile.TemporaryDirectory(prefix="relax-hf-multinode-bench-") as tmp:
        model = str(Path(tmp) / "model")
        out["model"] = make_random_model(Path(model), size, "bfloat16" if cuda else "float32")
        shape = (SIZES[size]["vocab_size"], SIZES[size]["hidden_size"])
        dtype = torch.bfloat16 if cuda else torch.float32
        env = {} if cuda else {"OMP_NUM_THREADS": "1"}

        def node(name: str, dev: str, **kw: Any) -> SubprocessEngineProcess:
            spec = EngineLaunchSpec(engine_id=name, model_path=model, device=dev, seed=0,
                                    options=EngineOptions(env=env),
                                    log_path=str(Path(tmp) / f"{name}.log"), **kw)  # fmt: skip
            procs.append(launch(spec))
            return procs[-1]

        def replica(name: str) -> tuple[SubprocessEngineProcess, SubprocessEngineProcess]:
            addr = f"127.0.0.1:{free_port()}"
            head = node(name, devices[0], nnodes=2, node_rank=0, dist_init_addr=addr)
            follower = node(f"{name}-node-1", devices[1], nnodes=2, node_rank=1,
                            dist_init_addr=addr)  # fmt: skip
            follower.wait_ready(900)
            head.wait_ready(900)
            return head, follower

        def throughput(http: Http, concurrency: int) -> float:
            best = 0.0
            for _ in range(1 if quick else 2):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(lambda _: http.ok("/generate", body, timeout=600),
                                  range(concurrency)))  # fmt: skip
                best = max(best, concurrency * tokens / (time.perf_counter() - t0))
            return best

        def sampled(http: Http) -> list[list[int]]:
            req = {
                "text": ["The quick", "Question: what", "def add"],
                "sampling_params": {"max_new_tokens": 32, "temperature": 0.8, "sampling_seed": 5},
            }
            return [o["output_ids"] for o in http.ok("/generate", req, timeout=600)]

        gen = torch.Generator().manual_seed(1)
        named = [(n, (torch.randn(*shape, generator=gen) * 0.02).to(dtype))
                 for n in ("lm_head.weight", "model.embed_tokens.weight")]  # fmt: skip
        update = {"serialized_named_tensors": [serialize_named_tensors(named,
                  load_format="safetensors")], "load_format": "safetensors"}  # fmt: skip
        out["update_bytes"] = sum(t.numel() * t.element_size() for _, t in named)

        def measure(http: Http, key: str) -> tuple[list[list[int]], list[list[int]]]:
            http.ok("/generate", body, timeout=600)  # warm-up
            out[key] = {"c1_tokens_per_s": throughput(http, 1),
                        "c16_tokens_per_s": throughput(http, 16)}  # fmt: skip
            before = sampled(http)
            t0 = time.perf_counter()
            http.ok("/update_weights_from_tensor", update, timeout=600)
            out[key]["update_seconds"] = time.perf_counter() - t0
            return before, sampled(http)

        try:
            single = node("single", devices[0])
            single.wait_ready(900)
            ref = measure(Http(str(single.base_url)), "single")
            single.terminate(30)

            head, follower = replica("replica")
            http = Http(str(head.base_url))
            got = measure(http, "replica")
            out["same_outputs_as_single"] = {"before_update": got[0] == ref[0],
                                             "after_update": got[1] == ref[1]}  # fmt: skip
            http.ok("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
            http.ok("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
            out["generates_after_release_resume"] = http.get("/health_generate")[0] == 200
            nodes = http.ok("/server_info")["nodes"]
            out["nodes"] = {k: nodes[k] for k in ("healthy", "steps_synced", "tokens_synced",
                                                  "diverged_tokens")}  # fmt: skip
            os.kill(follower.pid, signal.SIGKILL)
            out["follower_killed_head_503_seconds"] = _wait(
                lambda: http.get("/health_generate", timeout=60)[0] != 200, 60
            )
            out["head_alive_after"] = head.poll() is None
            head.terminate(30)

            head, follower = replica("replica2")
            os.kill(head.pid, signal.SIGKILL)
            out["head_killed_follower_exit_seconds"] = _wait(lambda: follower.poll() is not None,
                                                             60)  # fmt: skip
            out["follower_exit_code"] = follower.poll()
        finally:
            for p in procs:
                p.terminate(30)
    rep, one = out["replica"], out["single"]
    out["ratios"] = {
        "c1_replica_over_single": rep["c1_tokens_per_s"] / one["c1_tokens_per_s"],
        "c16_replica_over_single": rep["c16_tokens_per_s"] / one["c16_tokens_per_s"],
        "update_replica_over_single": rep["update_seconds"] / one["update_seconds"],
    }
    return out


def format_result(result: dict[str, Any]) -> str:
    """A human-readable summary of :func:`run`'s result."""
    one, rep, r = result["single"], result["replica"], result["ratios"]
    return "\n".join(
        [
            f"two-node hf replica vs one engine on {result['device']} ({result['size']} model)",
            f"  decode c1: {one['c1_tokens_per_s']:.1f} vs {rep['c1_tokens_per_s']:.1f} tok/s "
            f"(ratio {r['c1_replica_over_single']:.2f})",
            f"  decode c16: {one['c16_tokens_per_s']:.1f} vs {rep['c16_tokens_per_s']:.1f} tok/s "
            f"(ratio {r['c16_replica_over_single']:.2f})",
            f"  tensor update of {result['update_bytes'] / 2**20:.0f} MiB: "
            f"{one['update_seconds']:.2f} s vs {rep['update_seconds']:.2f} s",
            f"  same outputs as one engine: {json.dumps(result['same_outputs_as_single'])}; "
            f"node group: {json.dumps(result['nodes'])}",
            f"  follower killed -> head 503 in {result['follower_killed_head_503_seconds']:.2f} s; "
            f"head killed -> follower exit {result['follower_exit_code']} in "
            f"{result['head_killed_follower_exit_seconds']:.2f} s",
        ]
    )
