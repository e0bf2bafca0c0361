"""``relax-hf bench``: what batching and the prefix cache buy, on a tiny engine on CPU.

Real engine processes (launched through the ``hf`` backend) and real HTTP clients:

- **batching**: output tokens/s at concurrency 1 and 16; the goal is a ratio of at least 3.
- **shared prefix** (:func:`measure_shared_prefix`), on an engine with the prefix cache and
  one started with ``--disable-radix-cache``, in the same run: a group of 8 samples of one
  long prompt sent as 8 concurrent requests (how a rollout group, a judge's responses to one
  prompt or a teacher's group reach an engine), and a 10-turn conversation that re-sends its
  whole history every turn, token-exact (an agentic trajectory). For each: the tokens run
  through prefill and the wall time with and without the cache. The goal, on the
  conversation: at least 3x fewer prefill tokens and at least 1.5x faster.
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
#: The conversation with the prefix cache against without it: prefill tokens (fewer) and time.
GOAL_PREFILL_RATIO = 3.0
GOAL_SPEEDUP = 1.5
#: The shared-prefix workloads: a long system prompt (tool descriptions, a rubric), then turns.
SYSTEM_TOKENS = 1500
GROUP_SIZE = 8
TURNS = 10
USER_TOKENS = 60
ANSWER_TOKENS = 8


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


async def _prefill_tokens(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/server_info") as resp:
        resp.raise_for_status()
        return int((await resp.json())["prefill_tokens_total"])


async def _generate(
    session: aiohttp.ClientSession, url: str, ids: list[int], sampling: dict[str, Any]
) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": sampling}
    async with session.post(url + "/generate", json=body) as resp:
        resp.raise_for_status()
        return await resp.json()  # type: ignore[no-any-return]


def _words(tokenizer: Any, seed: int, tokens: int) -> list[int]:
    """About ``tokens`` token ids of varied text (no two seeds alike from their first token)."""
    import random

    rng = random.Random(seed)
    vocab = ["sea", "tool", "search", "answer", "result", "step", "plan", "file", "read", "the"]
    vocab += ["write", "check", "error", "value", "list", "open", "score", "judge", "call"]
    ids: list[int] = tokenizer(f"[{seed}]", add_special_tokens=False)["input_ids"]
    while len(ids) < tokens:
        ids += tokenizer(" " + rng.choice(vocab), add_special_tokens=False)["input_ids"]
    return ids[:tokens]


async def measure_shared_prefix(url: str, tokenizer: Any, *, seed: int) -> dict[str, Any]:
    """The two shared-prefix workloads on the engine at ``url`` (its prefix cache flushed
    first): prefill tokens (from ``/server_info``), wall seconds and the ``cached_tokens``
    the engine reported, for each."""
    timeout = aiohttp.ClientTimeout(total=600)
    turn = tokenizer("<|im_start|>", add_special_tokens=False)["input_ids"]
    end = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    head = tokenizer("user\n", add_special_tokens=False)["input_ids"]
    reply = tokenizer("assistant\n", add_special_tokens=False)["input_ids"]
    system = turn + tokenizer("system\n", add_special_tokens=False)["input_ids"]
    system += _words(tokenizer, seed, SYSTEM_TOKENS) + end
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/flush_cache") as resp:
            resp.raise_for_status()
        # A group: GROUP_SIZE samples of one prompt, sent together.
        prompt = system + turn + head + _words(tokenizer, seed + 1, USER_TOKENS) + end
        prompt += turn + reply
        sampled = {"max_new_tokens": ANSWER_TOKENS, "temperature": 1.0, "ignore_eos": True}
        before = await _prefill_tokens(session, url)
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(
                _generate(session, url, prompt, {**sampled, "sampling_seed": seed * 100 + i})
                for i in range(GROUP_SIZE)
            )
        )
        group = {
            "requests": GROUP_SIZE,
            "prompt_tokens": len(prompt),
            "seconds": time.perf_counter() - start,
            "prefill_tokens": await _prefill_tokens(session, url) - before,
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
        }
        # A conversation: every turn re-sends the history, the model's answers token-exact.
        history = list(system)
        greedy = {"max_new_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True}
        cached = 0
        before = await _prefill_tokens(session, url)
        start = time.perf_counter()
        for t in range(TURNS):
            history += turn + head + _words(tokenizer, seed + 2 + t, USER_TOKENS) + end
            history += turn + reply
            out = await _generate(session, url, history, greedy)
            cached += out["meta_info"]["cached_tokens"]
            history += out["output_ids"] + end
        conversation = {
            "turns": TURNS,
            "final_history_tokens": len(history),
            "seconds": time.perf_counter() - start,
            "prefill_tokens": await _prefill_tokens(session, url) - before,
            "cached_tokens": cached,
        }
    return {"group": group, "conversation": conversation}


def _compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    return {
        "with_cache": on,
        "without_cache": off,
        "prefill_tokens_saved": off["prefill_tokens"] - on["prefill_tokens"],
        "prefill_ratio": round(off["prefill_tokens"] / max(on["prefill_tokens"], 1), 2),
        "speedup": round(off["seconds"] / on["seconds"], 2),
    }


def run_shared_prefix(
    cached_url: str, uncached_url: str, tokenizer: Any, *, repeats: int
) -> dict[str, Any]:
    """The shared-prefix workloads on both engines, alternately ``repeats`` times; the fastest
    repetition of each (the machine may be busy) against each other."""

    async def all_runs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
        runs = []
        for r in range(repeats):
            on = await measure_shared_prefix(cached_url, tokenizer, seed=r)
            off = await measure_shared_prefix(uncached_url, tokenizer, seed=r)
            runs.append((on, off))
        return runs

    runs = asyncio.run(all_runs())
    out: dict[str, Any] = {}
    for name in ("group", "conversation"):
        on = min((r[0][name] for r in runs), key=lambda m: m["seconds"])
        off = min((r[1][name] for r in runs), key=lambda m: m["seconds"])
        out[name] = _compare(on, off)
    conv = out["conversation"]
    out["goal_prefill_ratio"] = GOAL_PREFILL_RATIO
    out["goal_speedup"] = GOAL_SPEEDUP
    out["ok"] = conv["prefill_ratio"] >= GOAL_PREFILL_RATIO and conv["speedup"] >= GOAL_SPEEDUP
    return out


def run(quick: bool = False) -> dict[str, Any]:
    """Start a tiny CPU engine (and one without the prefix cache), measure batching and the
    shared-prefix workloads, stop them; return the numbers."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from relax_core import EngineLaunchSpec, EngineOptions
    from relax_hf.plugin import launch
    from relax_hf.tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    max_new = 32 if quick else 64
    with tempfile.TemporaryDirectory(prefix="relax-hf-bench-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model)
        procs = [
            launch(
                EngineLaunchSpec(
                    engine_id=name,
                    model_path=str(model),
                    log_path=str(Path(tmp) / f"{name}.log"),
                    options=EngineOptions(extra_args=extra),
                )
            )
            for name, extra in (("bench", ()), ("bench-no-cache", ("--disable-radix-cache",)))
        ]
        try:
            for proc in procs:
                proc.wait_ready(180)
            url, uncached_url = (proc.base_url or "" for proc in procs)

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
            shared = run_shared_prefix(url, uncached_url, tokenizer, repeats=1 if quick else 3)
        finally:
            for proc in procs:
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
        "batching_ok": ratio >= GOAL_RATIO,
        "ok": ratio >= GOAL_RATIO and shared["ok"],
        "c1": c1,
        "c16": c16,
        "shared_prefix": shared,
    }


def format_result(result: dict[str, Any]) -> str:
    """A human-readable summary of :func:`run`'s result."""
    verdict = "OK" if result["batching_ok"] else "BELOW GOAL"
    lines = [
        f"hf engine on CPU, {result['model']}, {result['max_new_tokens']} new tokens per request",
        f"  concurrency  1: {result['c1_tokens_per_s']:8.1f} output tokens/s",
        f"  concurrency 16: {result['c16_tokens_per_s']:8.1f} output tokens/s",
        f"  ratio: {result['ratio_c16_over_c1']:.2f}x "
        f"(goal >= {result['goal_ratio']:.0f}x): {verdict}",
    ]
    shared = result["shared_prefix"]
    for name, what in (
        ("group", f"{GROUP_SIZE} samples of one {SYSTEM_TOKENS}-token prompt"),
        ("conversation", f"{TURNS}-turn conversation"),
    ):
        m = shared[name]
        on, off = m["with_cache"], m["without_cache"]
        lines.append(
            f"  prefix cache, {what}: prefill {off['prefill_tokens']} -> {on['prefill_tokens']} "
            f"tokens ({m['prefill_ratio']:.1f}x fewer), {off['seconds']:.3f} s -> "
            f"{on['seconds']:.3f} s ({m['speedup']:.2f}x faster)"
        )
    verdict = "OK" if shared["ok"] else "BELOW GOAL"
    lines.append(
        f"  conversation goal: >= {shared['goal_prefill_ratio']:.0f}x fewer prefill tokens and "
        f">= {shared['goal_speedup']}x faster: {verdict}"
    )
    return "\n".join(lines)
