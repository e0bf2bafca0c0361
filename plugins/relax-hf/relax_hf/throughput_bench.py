"""``relax-hf engine-throughput``: the engine's own generation speed at a step's shape.

``relax run --measure`` reports a phase's generated tokens (its engines' counters around the
switches); this runs the same model in one engine, alone, with the same memory options, at the
same concurrency and lengths — ``requests`` requests of ``prompt_tokens`` random token ids each,
``max_new_tokens`` new tokens each (``ignore_eos``), at most ``concurrency`` in flight — after
one warm-up round, and reports output tokens/s over the wall time. The phase's tokens/s over
this one is how much of the engine's speed a step keeps (tools/h200-issue34.sh).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

__all__ = ["format_result", "measure", "run"]


async def measure(
    url: str,
    *,
    concurrency: int,
    requests: int,
    prompt_tokens: int,
    max_new_tokens: int,
    temperature: float,
    vocab: int,
    seed: int = 0,
) -> dict[str, Any]:
    """``requests`` generations against ``url``, ``concurrency`` in flight; tokens/s."""
    import aiohttp

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(max(1, prompt_tokens))] for _ in range(requests)
    ]
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {
            "input_ids": prompts[i],
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "sampling_seed": seed * 100_003 + i,
                "ignore_eos": True,
            },
        }
        async with sem, session.post(url + "/generate", json=body) as resp:
            resp.raise_for_status()
            return int((await resp.json())["meta_info"]["completion_tokens"])

    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=max(1, concurrency))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        began = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(requests)))
        seconds = time.perf_counter() - began
    tokens = sum(counts)
    return {
        "requests": requests,
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
    }


def run(
    model: str,
    *,
    device: str = "cuda",
    dtype: str | None = None,
    concurrency: int = 256,
    requests: int = 256,
    prompt_tokens: int = 64,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    mem_fraction: float | None = None,
    max_running_requests: int | None = None,
    disable_cuda_graph: bool = False,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """Start one engine on ``model``, warm it up, measure, stop; the numbers."""
    import json
    import tempfile

    from relax_core import ControlClient, EngineLaunchSpec, EngineOptions
    from relax_hf.options import HFEngineOptions
    from relax_hf.plugin import launch

    config = json.loads((Path(model) / "config.json").read_text())
    vocab = int(config.get("vocab_size", 512))
    cuda = device.startswith("cuda")
    dtype = dtype or ("bfloat16" if cuda else "float32")
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="relax-hf-throughput-"))
    logs.mkdir(parents=True, exist_ok=True)
    spec = EngineLaunchSpec(
        engine_id="engine-throughput",
        model_path=str(model),
        device=device,
        log_path=str(logs / "engine-throughput.log"),
        options=EngineOptions(
            dtype=dtype,
            mem_fraction_static=mem_fraction if cuda else None,
            max_running_requests=max_running_requests,
        ),
        backend_options=HFEngineOptions(disable_cuda_graph=disable_cuda_graph),
    )
    result: dict[str, Any] = {"benchmark": "hf-engine-throughput", "model": str(model),
                              "device": device, "dtype": dtype}  # fmt: skip
    shape: dict[str, Any] = {
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "vocab": vocab,
    }
    proc = launch(spec)
    try:
        began = time.perf_counter()
        proc.wait_ready(900)
        result["engine_start_seconds"] = time.perf_counter() - began
        url = proc.base_url or ""

        async def both() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
            warm = await measure(url, requests=min(requests, concurrency), seed=1, **shape)
            timed = await measure(url, requests=requests, seed=0, **shape)
            async with ControlClient(url, timeout=60) as client:
                info = await client.server_info()
            return warm, timed, info

        warm, timed, info = asyncio.run(both())
        result["warm_up"] = warm
        result.update(timed)
        result["cuda_graphs"] = (info.get("memory") or {}).get("cuda_graphs")
        result["peak_running_reqs"] = info.get("peak_running_reqs")
    except BaseException:
        result["engine_log_tail"] = proc.log_tail()
        raise
    finally:
        proc.terminate(30)
    return result


def format_result(result: dict[str, Any]) -> str:
    """One line: the shape and the tokens/s."""
    return (
        f"engine throughput ({result['device']}): {result['requests']} requests, "
        f"{result['concurrency']} in flight, {result['prompt_tokens']} prompt + "
        f"{result['max_new_tokens']} new tokens: {result['output_tokens']} tokens in "
        f"{result['seconds']:.2f} s = {result['tokens_per_s']:.0f} tokens/s"
    )
