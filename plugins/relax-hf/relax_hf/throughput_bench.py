"""``relax-hf engine-throughput``: the engine's own generation speed at a step's shape.

``relax run --measure`` reports a phase's generated tokens (its engines' counters around the
switches); this runs the same model in one engine, alone, with the same memory options, at the
same concurrency and lengths — ``requests`` requests of ``prompt_tokens`` random token ids each,
``max_new_tokens`` new tokens each (``ignore_eos``), at most ``concurrency`` in flight — after
one warm-up round, and reports output tokens/s over the wall time. The phase's tokens/s over
this one is how much of the engine's speed a step keeps (tools/h200-issue34.sh).

``compare`` measures, in the same engine right after that baseline and at the same lengths and
concurrency, the requests as a phase sends them (each variant's tokens/s over the baseline's):
``shared-prefix`` (every prompt opens with the same ``shared_prefix_tokens`` ids, as the genrm
judge's prompts share their system prompt), ``chat`` (``/v1/chat/completions`` with
``messages``, a shared system prompt and a user turn, rendered by the engine as the judge
adapter's requests are) and ``rollout`` (``relax run``'s single-turn requests: ``n`` samples a
prompt and ``return_logprob``; ``concurrency`` counts samples).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["VARIANTS", "format_result", "hand_over", "measure", "run"]

#: What ``compare`` can measure against the random prompts.
VARIANTS = ("shared-prefix", "chat", "rollout")


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
    variant: str = "random",
    shared_prefix_tokens: int = 64,
    samples: int = 8,
) -> dict[str, Any]:
    """``requests`` generations against ``url``, ``concurrency`` in flight; tokens/s.

    ``variant``: ``random`` or one of :data:`VARIANTS` (see the module's docstring).
    :raises ValueError: another variant.
    """
    import aiohttp

    if variant != "random" and variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: give 'random' or one of {list(VARIANTS)}")
    rng = random.Random(seed)
    length = max(1, prompt_tokens)
    shared: list[int] = []
    if variant == "shared-prefix":
        shared = [rng.randrange(3, vocab) for _ in range(min(shared_prefix_tokens, length - 1))]
    prompts = [
        shared + [rng.randrange(3, vocab) for _ in range(length - len(shared))]
        for _ in range(requests)
    ]
    n = max(1, samples) if variant == "rollout" else 1
    sem = asyncio.Semaphore(max(1, concurrency // n))
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "ignore_eos": True,
    }
    extra: dict[str, Any] = {}
    if variant == "rollout":
        sampling |= {"n": n, "min_new_tokens": 1}
        extra = {"return_logprob": True}
    path, words = "/generate", 0
    if variant == "chat":  # as many words as make about prompt_tokens (the engine counts)
        path, words = "/v1/chat/completions", await _words_for(url, length)

    def body(i: int) -> dict[str, Any]:
        if variant == "chat":
            return {
                "messages": _chat_messages(rng, words),
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "seed": seed * 100_003 + i,
                "ignore_eos": True,
            }
        return {
            "input_ids": prompts[i],
            "sampling_params": {**sampling, "sampling_seed": seed * 100_003 + i},
            **extra,
        }

    bodies = [body(i) for i in range(-(-requests // n))]

    seen: list[int] = []  # each request's prompt tokens, as the engine counted them

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        async with sem, session.post(url + path, json=bodies[i]) as resp:
            resp.raise_for_status()
            answer = await resp.json()
        if variant == "chat":
            seen.append(int(answer["usage"]["prompt_tokens"]))
            return int(answer["usage"]["completion_tokens"])
        answers = answer if isinstance(answer, list) else [answer]
        seen.append(int(answers[0]["meta_info"]["prompt_tokens"]))
        return sum(int(a["meta_info"]["completion_tokens"]) for a in answers)

    async def steps(session: aiohttp.ClientSession) -> tuple[int, float]:
        async with session.get(url + "/server_info") as resp:
            resp.raise_for_status()
            info = await resp.json()
        n = int(info.get("prefill_steps_total", 0)) + int(info.get("decode_steps_total", 0))
        return n, float(info.get("step_seconds_total", 0.0))

    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=max(1, concurrency))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        steps_before, busy_before = await steps(session)
        began = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(len(bodies))))
        seconds = time.perf_counter() - began
        steps_after, busy_after = await steps(session)
    tokens = sum(counts)
    return {
        "requests": len(bodies) * n,
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "mean_prompt_tokens": sum(seen) / len(seen) if seen else None,
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        # forward passes (prefill or decode steps): what a step's fixed cost multiplies
        "engine_steps": steps_after - steps_before,
        # the engine's compute thread in steps over the seconds (1: never waited for work)
        "engine_busy": (busy_after - busy_before) / seconds if seconds > 0 else None,
    }


#: The judge's system prompt (shared by every chat request of the ``chat`` variant).
_SYSTEM = (
    "You are a strict judge. Read the question, the reference answer and the response. "
    "Reply with a short reason and end with 'score: 1' if the response is correct, else "
    "'score: 0'."
)
_WORDS = ("the", "answer", "is", "because", "sum", "of", "and", "so", "we", "get", "two", "ten")


def _chat_messages(rng: random.Random, words: int) -> list[dict[str, str]]:
    """A judge-like conversation: the shared system prompt, then a user turn of ``words``
    random words and numbers."""
    user = " ".join(
        rng.choice(_WORDS) if rng.random() < 0.7 else str(rng.randrange(100)) for _ in range(words)
    )
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


async def _words_for(url: str, prompt_tokens: int) -> int:
    """User-turn words that make a :func:`_chat_messages` prompt of about ``prompt_tokens``
    tokens under the engine's chat template (two ``/tokenize`` calls)."""
    import aiohttp

    rng = random.Random(0)
    counts = []
    async with aiohttp.ClientSession() as session:
        for words in (1, 201):
            body = {"messages": _chat_messages(rng, words)}
            async with session.post(url + "/tokenize", json=body) as resp:
                resp.raise_for_status()
                counts.append(int((await resp.json())["count"]))
    per_word = max(counts[1] - counts[0], 1) / 200
    return max(1, 1 + round((prompt_tokens - counts[0]) / per_word))


async def hand_over(url: str) -> None:
    """Release all of the engine at ``url``'s memory and resume it (its generation checked),
    once: the engine as a phase of ``relax run`` finds it after a switch (``--memory-handoff``:
    its memory back where it was, its graphs kept)."""
    from relax_core import ControlClient

    async with ControlClient(url, timeout=120) as client:
        await client.release_memory()
        await client.resume_memory(check_generation=True)


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
    compare: Sequence[str] = (),
    rounds: int = 1,
    shared_prefix_tokens: int = 64,
    samples: int = 8,
    num_continuous_decode_steps: int = 1,
    memory_handoff: bool = False,
) -> dict[str, Any]:
    """Start one engine on ``model``, warm it up, measure, stop; the numbers.

    ``compare``: variants (:data:`VARIANTS`) measured after the random prompts, ``rounds``
    times each in turn (a noisy machine: the median of each round's ratio counts); their
    numbers under ``variants``. ``num_continuous_decode_steps``: the engine's flag (as the
    phase's engine has it). ``memory_handoff`` (CUDA): the engine's flag, and one release and
    resume of all its memory after the warm-up, so that the engine measures with its memory
    where a phase of ``relax run`` finds it. :raises ValueError: an unknown variant, or
    ``rounds`` < 1.
    """
    unknown = [v for v in compare if v not in VARIANTS]
    if unknown or rounds < 1:
        raise ValueError(
            f"compare={unknown}: each variant is one of {list(VARIANTS)}"
            if unknown
            else f"rounds={rounds}: give at least 1"
        )
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
        backend_options=HFEngineOptions(
            disable_cuda_graph=disable_cuda_graph,
            num_continuous_decode_steps=num_continuous_decode_steps,
            memory_handoff=memory_handoff,
        ),
    )
    result: dict[str, Any] = {"benchmark": "hf-engine-throughput", "model": str(model),
                              "device": device, "dtype": dtype,
                              "num_continuous_decode_steps": num_continuous_decode_steps,
                              "memory_handoff": memory_handoff,
                              }  # fmt: skip
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

        names = ("random", *compare)

        async def every() -> tuple[dict[str, Any], dict[str, list[Any]], dict[str, Any]]:
            warm = await measure(url, requests=min(requests, concurrency), seed=1, **shape)
            if memory_handoff:
                await hand_over(url)
            runs: dict[str, list[Any]] = {name: [] for name in names}
            options = {"shared_prefix_tokens": shared_prefix_tokens, "samples": samples}
            for r in range(rounds):
                for v, name in enumerate(names):
                    # A seed of its own each time: no prompt is in the prefix cache already.
                    seed = 0 if r == v == 0 else 2 + r * len(names) + v
                    measured = await measure(
                        url, requests=requests, seed=seed, variant=name, **options, **shape
                    )
                    runs[name].append(measured)
            async with ControlClient(url, timeout=60) as client:
                info = await client.server_info()
            return warm, runs, info

        warm, runs, info = asyncio.run(every())
        result["warm_up"] = warm
        result.update(runs["random"][0])
        if compare or rounds > 1:
            result["variants"] = _variants(runs)
        result["cuda_graphs"] = (info.get("memory") or {}).get("cuda_graphs")
        result["peak_running_reqs"] = info.get("peak_running_reqs")
    except BaseException:
        result["engine_log_tail"] = proc.log_tail()
        raise
    finally:
        proc.terminate(30)
    return result


def _variants(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each variant's tokens/s by round and over the same round's random prompts."""
    base = [m["tokens_per_s"] for m in runs["random"]]
    out: dict[str, Any] = {}
    for name, measured in runs.items():
        rates = [m["tokens_per_s"] for m in measured]
        ratios = [x / b for x, b in zip(rates, base, strict=True) if x and b]
        out[name] = {
            "tokens_per_s": [round(x, 1) for x in rates],
            "mean_prompt_tokens": measured[-1]["mean_prompt_tokens"],
            "output_tokens": measured[-1]["output_tokens"],
            "engine_steps": [m["engine_steps"] for m in measured],
            "engine_busy": [
                None if m["engine_busy"] is None else round(m["engine_busy"], 3) for m in measured
            ],
            "over_random": [round(x, 3) for x in ratios],
            "median_over_random": round(statistics.median(ratios), 3) if ratios else None,
        }
    return out


def format_result(result: dict[str, Any]) -> str:
    """One line: the shape and the tokens/s (and a line per compared variant)."""
    line = (
        f"engine throughput ({result['device']}): {result['requests']} requests, "
        f"{result['concurrency']} in flight, {result['prompt_tokens']} prompt + "
        f"{result['max_new_tokens']} new tokens: {result['output_tokens']} tokens in "
        f"{result['seconds']:.2f} s = {result['tokens_per_s']:.0f} tokens/s"
    )
    for name, v in (result.get("variants") or {}).items():
        rates = ", ".join(f"{x:.0f}" for x in v["tokens_per_s"])
        line += (
            f"\n  {name}: {rates} tokens/s in {v['engine_steps']} engine steps; over random: "
            f"median {v['median_over_random']} of {v['over_random']}"
        )
    return line
