"""How many prefill steps an hf engine runs for requests that arrive one by one while others
decode, at ``--num-continuous-decode-steps N`` (admission at most once every N steps).

    python tools/admission-probe.py MODEL [--steps 1 4 16] [--device cpu|cuda]
        [--running 16] [--arrivals 32] [--gap-ms 10]

For each N: one engine; ``--running`` requests of 200 new tokens start, then ``--arrivals``
short requests (30-token prompts, 8 new tokens) arrive ``--gap-ms`` apart; prints the engine's
prefill steps, decode steps and scheduler runs over all of them (``/server_info`` counters).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from typing import Any

import aiohttp
from relax_hf.testing import start_engine

COUNTERS = ("prefill_steps_total", "decode_steps_total", "scheduler_runs_total")


async def measure(url: str, running: int, arrivals: int, gap: float) -> dict[str, int]:
    rng = random.Random(0)
    async with aiohttp.ClientSession() as session:

        async def generate(prompt_len: int, new_tokens: int) -> None:
            body = {
                "input_ids": [rng.randrange(3, 200) for _ in range(prompt_len)],
                "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
            }
            async with session.post(url + "/generate", json=body) as resp:
                resp.raise_for_status()
                await resp.read()

        async def counters() -> dict[str, int]:
            async with session.get(url + "/server_info") as resp:
                info: dict[str, Any] = await resp.json()
            return {k: int(info.get(k, 0)) for k in COUNTERS}

        await generate(20, 4)  # warm-up
        before = await counters()
        tasks = [asyncio.create_task(generate(20, 200)) for _ in range(running)]
        await asyncio.sleep(0.3)  # the long ones are decoding
        for _ in range(arrivals):
            tasks.append(asyncio.create_task(generate(30, 8)))
            await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
        after = await counters()
    return {k: after[k] - before[k] for k in COUNTERS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--device", default="cpu")
    p.add_argument("--running", type=int, default=16)
    p.add_argument("--arrivals", type=int, default=32)
    p.add_argument("--gap-ms", type=float, default=10.0)
    args = p.parse_args()
    for n in args.steps:
        server = start_engine(
            args.model,
            tempfile.mkdtemp(prefix="admission-probe-"),
            f"admission-{n}",
            device=args.device,
            extra_args=("--num-continuous-decode-steps", str(n)),
        )
        try:
            url = server.process.base_url or ""
            got = asyncio.run(measure(url, args.running, args.arrivals, args.gap_ms / 1000))
        finally:
            server.process.terminate(10)
        print(f"N = {n}: " + ", ".join(f"{k} {v}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
