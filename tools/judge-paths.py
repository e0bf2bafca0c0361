"""The genrm judge's requests along each path to one hf engine, at the same concurrency.

    python tools/judge-paths.py MODEL [--device cpu|cuda] [--concurrency 64] [--requests 256]
        [--max-new-tokens 64] [--rounds 2] [--mem-fraction-static F] [--memory-handoff] [--cold]
        [--longer N] [--json]

One engine on MODEL (a checkpoint with a chat template: relax-hf make-tiny-model makes one),
then, in turn and ``--rounds`` times, ``--requests`` judge requests of arithmetic samples
(greedy, ``--max-new-tokens``), ``--concurrency`` in flight, along each path:

- ``random``: ``/generate`` with random token ids, each as long as that sample's rendered
  judge prompt (the engine alone, as ``relax-hf engine-throughput`` measures it);
- ``judge-ids``: ``/generate`` with the judge prompts rendered here (they share the system
  prompt: the prefix cache's path);
- ``gateway``: the genrm gateway's ``/genrm/generate`` with ``messages`` (rendered by its
  adapter in the gateway's thread pool), served in this process;
- ``reward-stage``: a ``RewardStage`` with the ``genrm-judge`` adapter (the reward stage of
  ``relax run``: ``/v1/chat/completions`` through the role's client, rendered by the engine).

With ``--cold`` each path's round starts as a run's judge phase does after a switch: the
engine's prefix cache empty (flushed; with ``--memory-handoff``, released and resumed, which
flushes it too), so the judge prompts' shared system prompt is not cached yet.

Each path's tokens/s is the engine's generated tokens (``/server_info`` counters) over the wall
time, with its prefill and decode steps and the runs they came in (``scheduler_runs_total``: each
run ends with a hand-over to the engine's scheduler loop); the ratio is over the same round's
``random``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

PATHS = ("random", "judge-ids", "gateway", "reward-stage")
COUNTERS = (
    "generation_tokens_total", "prefill_steps_total", "decode_steps_total", "scheduler_runs_total",
    "decode_steps_ahead_total",
)  # fmt: skip


def samples(n: int, seed: int, longer: int = 0) -> list[Any]:
    """``n`` arithmetic samples; ``longer`` more sentences in each response (~12 tokens each)."""
    from relax_core import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        said = f"We add {a} and {b}. " * (rng.randrange(1, 4) + longer)
        response = f"{said}The answer is {a + b + rng.randrange(2)}."
        prompt = f"What is {a} + {b}?"
        out.append(Sample(f"s{i}", f"g{i // 8}", [1], [2], prompt=prompt, response=response,
                          label=str(a + b)))  # fmt: skip
    return out


def main() -> None:
    from relax_genrm.judge import JUDGE_SAMPLING, render_judge_messages
    from relax_hf.options import HFEngineOptions
    from relax_hf.plugin import launch
    from relax_hf.throughput_bench import hand_over
    from transformers import AutoTokenizer

    from relax_core import (
        ControlClient,
        EngineLaunchSpec,
        EngineOptions,
        PluginManager,
        RegistryPublisher,
        RewardStage,
        RoleClients,
        RoutingSpec,
        StageContext,
    )
    from relax_core.gateway import GatewayOptions, GatewayServer, gateway_app

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=JUDGE_SAMPLING["max_new_tokens"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--num-continuous-decode-steps",
        type=int,
        default=1,
        help="the engine's flag: arrivals admitted at most once every N steps",
    )
    p.add_argument(
        "--cuda-graph-backend-prefill",
        choices=("full", "disabled"),
        default="full",
        help="the engine's flag: a few prompts after a cached prefix replay a prefill graph",
    )
    p.add_argument(
        "--memory-handoff",
        action="store_true",
        help="the engine's flag (CUDA), and one release and resume of all its memory after the "
        "warm-up, as a run's judge engine has it between phases",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="empty the prefix cache before every path's round (with --memory-handoff: release "
        "and resume all memory), as a run's judge phase finds it after a switch",
    )
    p.add_argument(
        "--longer",
        type=int,
        default=0,
        help="this many more sentences in each sample's response (~12 tokens each): 3 makes "
        "the judge prompts about as long as run-h200.toml's (~210 tokens: contexts past 256)",
    )
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    tok = AutoTokenizer.from_pretrained(args.model)
    logs = Path(tempfile.mkdtemp(prefix="judge-paths-"))
    spec = EngineLaunchSpec(
        engine_id="judge",
        model_path=args.model,
        device=args.device,
        log_path=str(logs / "engine.log"),
        options=EngineOptions(
            dtype="bfloat16" if cuda else "float32",
            mem_fraction_static=args.mem_fraction_static if cuda else None,
            max_running_requests=256,
        ),
        backend_options=HFEngineOptions(
            num_continuous_decode_steps=args.num_continuous_decode_steps,
            cuda_graph_backend_prefill=args.cuda_graph_backend_prefill,
            memory_handoff=args.memory_handoff,
        ),
    )
    pm = PluginManager.create()
    publisher = RegistryPublisher("genrm", RoutingSpec(default_model="judge"))
    proc = launch(spec)
    gateway = None
    try:
        proc.wait_ready(900)
        url = proc.base_url or ""
        publisher.set_model(
            "judge", state="READY", route_mode="DIRECT", weight_source="STATIC",
            served_model_name="judge",
        )  # fmt: skip
        publisher.set_engine("judge", "judge/0", base_url=url, state="READY")
        options = GatewayOptions(model_paths={"judge": args.model})
        app = gateway_app("genrm", publisher.snapshot, plugin_manager=pm, options=options)
        gateway = GatewayServer(app).start()
        sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}

        def messages(s: Any) -> list[dict[str, str]]:
            return render_judge_messages(s.prompt, s.response, s.label)

        def ids(s: Any) -> list[int]:
            text = tok.apply_chat_template(messages(s), tokenize=False, add_generation_prompt=True)
            return list(tok.encode(text, add_special_tokens=False))

        async def post_all(target: str, bodies: list[dict[str, Any]]) -> None:
            gate = asyncio.Semaphore(args.concurrency)
            connector = aiohttp.TCPConnector(limit=args.concurrency)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one(body: dict[str, Any]) -> None:
                    async with gate, session.post(target, json=body) as resp:
                        resp.raise_for_status()
                        await resp.read()

                await asyncio.gather(*map(one, bodies))

        async def send(path: str, seed: int) -> None:
            batch = samples(args.requests, seed, args.longer)
            if path == "random":
                rng = random.Random(seed)
                bodies = [
                    {"input_ids": [rng.randrange(3, len(tok)) for _ in ids(s)],
                     "sampling_params": sampling}
                    for s in batch
                ]  # fmt: skip
                await post_all(url + "/generate", bodies)
            elif path == "judge-ids":
                bodies = [{"input_ids": ids(s), "sampling_params": sampling} for s in batch]
                await post_all(url + "/generate", bodies)
            elif path == "gateway":
                bodies = [{"messages": messages(s), "sampling_params": sampling} for s in batch]
                await post_all(gateway.url + "/genrm/generate", bodies)  # type: ignore[union-attr]
            else:
                judge = pm.reward_adapter("genrm-judge")
                stage = RewardStage([judge], role="genrm", concurrency=args.concurrency)
                clients = RoleClients({"genrm": publisher.snapshot})
                await stage.run(batch, StageContext(seed, clients))

        def counters() -> dict[str, int]:
            with urllib.request.urlopen(url + "/server_info") as resp:
                info = json.load(resp)
            out = {k: int(info.get(k, 0)) for k in COUNTERS}
            out["cached_tokens"] = int(info.get("prefix_cache", {}).get("cached_tokens_total", 0))
            return out

        async def cool() -> None:
            if args.memory_handoff:
                await hand_over(url)
                return
            async with ControlClient(url, timeout=120) as client:
                await client.flush_cache(wait=30)

        async def measure() -> dict[str, list[dict[str, Any]]]:
            await send("random", 999)  # warm-up
            if args.memory_handoff and not args.cold:  # --cold hands over before every round
                await hand_over(url)
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
            for r in range(args.rounds):
                for v, path in enumerate(PATHS):
                    if args.cold:
                        await cool()
                    before, began = counters(), time.perf_counter()
                    await send(path, 10 * r + v)
                    seconds = time.perf_counter() - began
                    after = counters()
                    d = {k: after[k] - before[k] for k in after}
                    rate = d["generation_tokens_total"] / seconds
                    runs[path].append({"seconds": round(seconds, 3), "tokens_per_s": round(rate, 1),
                                       "prefill_steps": d["prefill_steps_total"],
                                       "decode_steps": d["decode_steps_total"],
                                       "runs": d["scheduler_runs_total"],
                                       "ahead": d["decode_steps_ahead_total"],
                                       "cached_tokens": d["cached_tokens"]})  # fmt: skip
            return runs

        # The rounds' requests, not this process's start-up heap, are what a collection scans
        # (``relax run`` freezes its own the same way once the job has started).
        gc.collect()
        gc.freeze()
        runs = asyncio.run(measure())
    finally:
        if gateway is not None:
            gateway.stop()
        proc.terminate(30)
    base = [m["tokens_per_s"] for m in runs["random"]]
    result: dict[str, Any] = {"model": args.model, "device": args.device,
                              "concurrency": args.concurrency, "requests": args.requests,
                              "max_new_tokens": args.max_new_tokens,
                              "num_continuous_decode_steps": args.num_continuous_decode_steps,
                              "cuda_graph_backend_prefill": args.cuda_graph_backend_prefill,
                              "memory_handoff": args.memory_handoff, "cold": args.cold,
                              "longer": args.longer,
                              "paths": {}}  # fmt: skip
    for path, measured in runs.items():
        ratios = [m["tokens_per_s"] / b for m, b in zip(measured, base, strict=True)]
        result["paths"][path] = {
            "runs": measured,
            "over_random": [round(x, 3) for x in ratios],
            "median_over_random": round(statistics.median(ratios), 3),
        }
    if args.json:
        print(json.dumps(result))
        return
    for path, row in result["paths"].items():
        rates = ", ".join(f"{m['tokens_per_s']:.0f}" for m in row["runs"])
        steps = ", ".join(
            f"{m['prefill_steps']}+{m['decode_steps']} ({m['ahead']} started ahead) in "
            f"{m['runs']} runs, {m['cached_tokens']} prompt tokens cached"
            for m in row["runs"]
        )
        print(f"{path}: {rates} tokens/s, prefill+decode steps {steps}; over random: "
              f"median {row['median_over_random']} of {row['over_random']}")  # fmt: skip


if __name__ == "__main__":
    main()
