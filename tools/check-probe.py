"""The onload's generation check after a phase: one hf engine server (a model directory, CPU by
default), then ``--cycles`` rounds of a workload, a release and a resume with the generation
check (``check_generation``, as the manager's onload asks), each round with the workload and
then one without; prints the check's milliseconds and, of them, the engine's steps (from the
resume's own answer).

    python tools/check-probe.py MODEL [--workload top-k|plain|none] [--cycles 3] [--json]

``top-k``: 256 prompts of 96 tokens prefilled with the top 8 log-probs at every position (the
teacher's phase); ``plain``: the same without log-probs; ``none``: no workload. The check's
milliseconds outside the engine's steps are the scheduler's (docs/benchmarks.md). Needs
relax-hf and aiohttp installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _probe(url: str, workload: str, cycles: int) -> list[dict[str, Any]]:
    import aiohttp

    async def post(s: Any, path: str, body: dict[str, Any]) -> Any:
        async with s.post(url + path, json=body) as r:
            r.raise_for_status()
            return await r.json(content_type=None)

    rows = []
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + 300
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy after 300 s")
            await asyncio.sleep(0.2)
        for cycle in range(2 * cycles):
            kind = workload if cycle % 2 == 0 else "none"
            if kind != "none":
                sp = {"max_new_tokens": 1, "temperature": 0.0}
                extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 8}
                bodies = [
                    {"input_ids": [(7 * i + j) % 200 + 5 for j in range(96)], "sampling_params": sp}
                    | (extra if kind == "top-k" else {})
                    for i in range(256)
                ]
                await asyncio.gather(*(post(s, "/generate", b) for b in bodies))
            await post(s, "/release_memory_occupation", {})
            got = await post(s, "/resume_memory_occupation", {"check_generation": True})
            detail = got.get("detail") or {}
            check = detail["generation_check_seconds"] * 1e3
            step = detail["generation_check_step_seconds"] * 1e3
            rows.append(
                {"after": kind, "check_ms": check, "step_ms": step, "outside_ms": check - step}
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--workload", choices=("top-k", "plain", "none"), default="top-k")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    port = _free_port()
    with tempfile.TemporaryFile("w+") as log:
        cmd = [sys.executable, "-m", "relax_hf", "serve", "--model-path", args.model]
        cmd += ["--port", str(port), "--device", args.device]
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ))
        try:
            rows = asyncio.run(_probe(f"http://127.0.0.1:{port}", args.workload, args.cycles))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    summary = {
        kind: round(statistics.median(r["outside_ms"] for r in rows if r["after"] == kind), 2)
        for kind in dict.fromkeys(r["after"] for r in rows)
    }
    if args.json:
        print(json.dumps({"rows": rows, "outside_ms_median": summary}))
    else:
        for r in rows:
            print(
                f"after {r['after']:>6}: check {r['check_ms']:6.2f} ms, of it steps "
                f"{r['step_ms']:6.2f}, outside {r['outside_ms']:5.2f}"
            )
        print("median outside the steps:", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
