"""``relax demo``: all three roles on tiny hf models on CPU, one request each through the gateways.

Makes three tiny models in a temporary directory (``python -m relax_hf make-tiny-model``: the
core never imports the hf plugin), writes a job file, brings it up with the ``relax serve``
machinery on a local Ray, sends a rollout generation, a genrm judgement (messages protocol) and
a teacher prefill (log-probs and top-k) through the role gateways, prints the answers, and
shuts everything down.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from relax_core.config import load_config
from relax_core.errors import ConfigError

NAME = "demo"
HELP = "Serve rollout, genrm and teacher on tiny CPU models and send one request to each."

__all__ = ["demo_config"]


def demo_config(models: dict[str, Path]) -> str:
    """The demo's job file: one CPU hf engine per role; rollout routed DIRECT (no router)."""
    return f"""\
[cluster]
num_nodes = 1
gpus_per_node = 0

[roles.rollout.models.policy]
backend = "hf"
device = "cpu"
model_path = "{models["policy"]}"
route_mode = "DIRECT"
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


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _make_models(root: Path) -> dict[str, Path]:
    models = {}
    for seed, name in enumerate(("policy", "judge", "math")):
        path = root / name
        done = subprocess.run(
            [sys.executable, "-m", "relax_hf", "make-tiny-model", str(path), "--seed", str(seed)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise ConfigError(
                "relax demo",
                f"making the tiny model {name!r} failed (is relax-hf installed? "
                f"`pip install -e plugins/relax-hf`): {done.stderr.strip()[-400:]}",
            )
        models[name] = path
    return models


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", action="store_true", help="keep serving until Ctrl-C")


def run(args: argparse.Namespace) -> int:
    from relax_core.commands.serve import ray_session, serve_job

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relax-demo-") as tmp:
        root = Path(tmp)
        print("relax demo: making three tiny models (CPU, no downloads) …", flush=True)
        models = _make_models(root)
        config_path = root / "job.toml"
        config_path.write_text(demo_config(models))
        config = load_config(config_path)
        with ray_session(None, config):
            print("relax demo: starting rollout, genrm and teacher engines …", flush=True)
            with serve_job(config, log_dir=str(root / "logs")) as job:
                urls = job.urls
                for role, url in urls.items():
                    print(f"  {role:8} gateway  {url}/{role}/")
                print(job.status())
                rollout = _post(
                    f"{urls['rollout']}/rollout/generate",
                    {
                        "text": "Once upon a time",
                        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                    },
                )
                print(f"\nrollout  /generate        → text: {rollout['text']!r}")
                judge = _post(
                    f"{urls['genrm']}/genrm/generate",
                    {
                        "messages": [
                            {"role": "user", "content": "Question: 2+2? Response: 4. Correct?"}
                        ],
                        "route_key": "math",
                        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                    },
                )
                print(f"genrm    /generate        → {judge}")
                prefill = _post(
                    f"{urls['teacher']}/teacher/generate",
                    {
                        "input_ids": [5, 6, 7, 8, 9],
                        "model": "teacher-checkpoint",
                        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                        "return_logprob": True,
                        "logprob_start_len": 2,
                        "top_logprobs_num": 2,
                    },
                )
                lps = prefill["meta_info"]["input_token_logprobs"]
                print(
                    f"teacher  /generate prefill → {len(lps)} input log-probs, e.g. "
                    f"{[round(x[0], 3) for x in lps[1:] if x[0] is not None]}"
                )
                if args.keep:
                    print("serving until Ctrl-C …", flush=True)
                    try:
                        while True:
                            time.sleep(3600)
                    except KeyboardInterrupt:
                        pass
            print("relax demo: shutting down …", flush=True)
    print(f"relax demo: done in {time.monotonic() - began:.0f}s; nothing left running", flush=True)
    return 0
