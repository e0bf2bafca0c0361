"""``relax-hf bench``: output tokens/s of a tiny engine on CPU at concurrency 1 and 16.

A real engine process (launched through the ``hf`` backend) and real HTTP clients: the ratio
of the two throughputs, measured in the same run, shows what continuous batching buys. The
goal is a ratio of at least 3.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["format_result", "measure_throughput", "run"]

GOAL_RATIO = 3.0


async def measure_throughput(
    url: str, *, concurrency: int, requests_per_client: int, max_new_tokens: int
) -> dict[str, Any]:
    """``concurrency`` clients sending requests back to back; output tokens/s over the wall time."""

    async def client(session: aiohttp.ClientSession, cid: int) -> int:
        tokens = 0
        for i in range(requests_per_client):
            body = {
                "text": f"Client {cid} request {i}: tell me a story about the sea.",
                "sampling_params": {
                    "max_new_tokens": max_new_tokens,
                    "temperature": 1.0,
                    "sampling_seed": cid * 1000 + i,
                    "ignore_eos": True,
                },
            }
            async with session.post(url + "/generate", json=body) as resp:
                resp.raise_for_status()
                tokens += int((await resp.json())["meta_info"]["completion_tokens"])
        return tokens

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(client(session, c) for c in range(concurrency)))
        elapsed = time.perf_counter() - start
    total = sum(counts)
    return {
        "concurrency": concurrency,
        "requests": concurrency * requests_per_client,
        "output_tokens": total,
        "seconds": elapsed,
        "tokens_per_s": total / elapsed,
    }


def run(quick: bool = False) -> dict[str, Any]:
    """Start a tiny CPU engine, measure concurrency 1 and 16, stop it; return the numbers."""
    from transformers.utils import logging as hf_logging

    from relax_core import EngineLaunchSpec
    from relax_hf.plugin import launch
    from relax_hf.tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    max_new = 32 if quick else 64
    with tempfile.TemporaryDirectory(prefix="relax-hf-bench-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        proc = launch(
            EngineLaunchSpec(
                engine_id="bench", model_path=str(model), log_path=str(Path(tmp) / "engine.log")
            )
        )
        try:
            proc.wait_ready(180)
            url = proc.base_url or ""

            async def both() -> tuple[dict[str, Any], dict[str, Any]]:
                await measure_throughput(
                    url, concurrency=4, requests_per_client=1, max_new_tokens=8
                )  # warm-up
                c1 = await measure_throughput(
                    url,
                    concurrency=1,
                    requests_per_client=4 if quick else 8,
                    max_new_tokens=max_new,
                )
                c16 = await measure_throughput(
                    url,
                    concurrency=16,
                    requests_per_client=1 if quick else 2,
                    max_new_tokens=max_new,
                )
                return c1, c16

            c1, c16 = asyncio.run(both())
        finally:
            proc.terminate(10)
    ratio = c16["tokens_per_s"] / c1["tokens_per_s"]
    return {
        "benchmark": "hf-engine-batching",
        "device": "cpu",
        "model": "tiny (4 layers, hidden 256, ~4M params)",
        "max_new_tokens": max_new,
        "c1_tokens_per_s": round(c1["tokens_per_s"], 1),
        "c16_tokens_per_s": round(c16["tokens_per_s"], 1),
        "ratio_c16_over_c1": round(ratio, 2),
        "goal_ratio": GOAL_RATIO,
        "ok": ratio >= GOAL_RATIO,
        "c1": c1,
        "c16": c16,
    }


def format_result(result: dict[str, Any]) -> str:
    """A human-readable summary of :func:`run`'s result."""
    verdict = "OK" if result["ok"] else "BELOW GOAL"
    return (
        f"hf engine on CPU, {result['model']}, {result['max_new_tokens']} new tokens per request\n"
        f"  concurrency  1: {result['c1_tokens_per_s']:8.1f} output tokens/s\n"
        f"  concurrency 16: {result['c16_tokens_per_s']:8.1f} output tokens/s\n"
        f"  ratio: {result['ratio_c16_over_c1']:.2f}x "
        f"(goal >= {result['goal_ratio']:.0f}x): {verdict}"
    )
