"""``relax demo``: all three roles on tiny hf models on CPU, one request each through the gateways.

Makes three tiny models in a temporary directory (``python -m relax_hf make-tiny-model``, in
parallel: the core never imports the hf plugin), writes a job file, brings it up with the
``relax serve`` machinery on a new local Ray (rollout behind its default router plugin), sends a
rollout generation, a genrm judgement
(messages protocol, chosen by route key) and a teacher prefill (log-probs and top-k, chosen by
alias) through the role gateways, prints the answers and the time of each phase, and shuts
everything down, checking that no engine process is left.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from relax_core.config import load_config
from relax_core.errors import ConfigError, LifecycleError

NAME = "demo"
HELP = "Serve rollout, genrm and teacher on tiny CPU models and send one request to each."

__all__ = ["demo_config"]

_MODELS = ("policy", "judge", "math")


def demo_config(models: dict[str, Path]) -> str:
    """The demo's job file: one CPU hf engine per role; rollout through its default router."""
    return f"""\
[cluster]
num_nodes = 1
gpus_per_node = 0

[roles.rollout.models.policy]
backend = "hf"
device = "cpu"
model_path = "{models["policy"]}"
weight_source = "ACTOR"

[roles.genrm.models.judge]
backend = "hf"
device = "cpu"
model_path = "{models["judge"]}"
route_keys = ["math"]

[roles.teacher.models.math]
backend = "hf"
device = "cpu"
model_path = "{models["math"]}"
aliases = ["teacher-checkpoint"]
"""


def _post(url: str, body: dict[str, Any]) -> tuple[Any, float]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    began = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read()), time.monotonic() - began
    except urllib.error.HTTPError as err:
        raise LifecycleError(
            f"POST {url} answered {err.code}: {err.read().decode('utf-8', 'replace')[:400]}"
        ) from None


def _make_models(root: Path) -> dict[str, Path]:
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relax_hf",
                "make-tiny-model",
                str(root / name),
                "--seed",
                f"{seed}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed, name in enumerate(_MODELS)
    }
    problems = []
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            problems.append(f"{name}: {err.strip()[-400:]}")
    if problems:
        raise ConfigError(
            "relax demo",
            "making the tiny models failed (is relax-hf installed? `pip install -e "
            "plugins/relax-hf`):\n  " + "\n  ".join(problems),
        )
    return {name: root / name for name in _MODELS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", action="store_true", help="keep serving until Ctrl-C")


class _Clock:
    def __init__(self) -> None:
        self.began = self.mark = time.monotonic()
        self.phases: list[tuple[str, float]] = []

    def stamp(self) -> str:
        return f"[{time.monotonic() - self.began:5.1f}s]"

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self.mark))
        self.mark = now

    def summary(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in self.phases)
        return f"{time.monotonic() - self.began:.0f}s ({parts})"


def _ask(urls: dict[str, str], out: Any) -> None:
    print("\nanswers (the models are random: the words are noise, the plumbing is real):")
    rollout, took = _post(
        f"{urls['rollout']}/rollout/generate",
        {
            "text": "Once upon a time",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
    )
    tokens = rollout["meta_info"].get("completion_tokens", "?")
    print("  rollout  POST /rollout/generate  text 'Once upon a time', 8 new tokens, greedy")
    print(f"           → {rollout['text']!r}  ({tokens} tokens, {took * 1000:.0f} ms)")
    judge, took = _post(
        f"{urls['genrm']}/genrm/generate",
        {
            "messages": [{"role": "user", "content": "Question: 2+2? Response: 4. Correct?"}],
            "route_key": "math",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    )
    print("  genrm    POST /genrm/generate    chat messages, route_key 'math' → model judge")
    print(f"           → response {judge['response']!r}  ({took * 1000:.0f} ms)")
    prefill, took = _post(
        f"{urls['teacher']}/teacher/generate",
        {
            "input_ids": [5, 6, 7, 8, 9],
            "model": "teacher-checkpoint",
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 2,
        },
    )
    meta = prefill["meta_info"]
    lps = [None if x[0] is None else round(x[0], 3) for x in meta["input_token_logprobs"]]
    top = meta.get("input_top_logprobs") or []
    first_top: list[Any] = next((t for t in top if t), [])
    print(
        "  teacher  POST /teacher/generate  5 input ids, prefill only, model alias "
        "'teacher-checkpoint' → math"
    )
    print(
        f"           → input log-probs {lps}; top-2 at the first scored position "
        f"{[(t[1], round(t[0], 3)) for t in first_top]}  ({took * 1000:.0f} ms)"
    )


def run(args: argparse.Namespace) -> int:
    from relax_core.plugins import PluginManager
    from relax_core.service import ShutdownSignals, describe_job, ray_session, serve_job

    out = sys.stdout
    clock = _Clock()
    signals = ShutdownSignals(out)
    signals.install()
    print("relax demo: rollout, genrm and teacher on tiny CPU models (no GPU, no downloads)")
    with tempfile.TemporaryDirectory(prefix="relax-demo-") as tmp:
        root = Path(tmp)
        print(f"{clock.stamp()} making three tiny models: {', '.join(_MODELS)} …", flush=True)
        models = _make_models(root)
        clock.lap("models")
        config_path = root / "job.toml"
        config_path.write_text(demo_config(models))
        config = load_config(config_path)
        pm = PluginManager.create()

        def stopping() -> None:
            if not signals.holding:
                signals.hold()
                clock.lap("requests" if len(clock.phases) == 3 else "serving")
                print(f"{clock.stamp()} shutting down …", flush=True)

        try:
            with ray_session(None, config, out) as where:
                clock.lap("ray")
                print(f"{clock.stamp()} started {where}; starting the engines:", flush=True)
                print("\n".join(describe_job(config, pm)), flush=True)
                with serve_job(
                    config,
                    plugin_manager=pm,
                    out=out,
                    log_dir=str(root / "logs"),
                    health_interval=0,
                    before_teardown=stopping,
                ) as job:
                    clock.lap("engines")
                    print(f"{clock.stamp()} gateways:")
                    for role, gw in job.gateways.items():
                        print(f"  {role:8} {gw.url}/{role}/")
                    print(job.status())
                    _ask(job.urls, out)
                    if args.keep:
                        print("\nserving until Ctrl-C …", flush=True)
                        while True:
                            time.sleep(3600)
        except KeyboardInterrupt:
            print("relax demo: interrupted", flush=True)
        clock.lap("shutdown")
    print(f"relax demo: done in {clock.summary()}; nothing left running", flush=True)
    return 0
