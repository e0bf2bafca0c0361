"""``relax demo``: ``relax run`` on the embedded default job (:data:`DEMO_JOB`), after making
its three tiny random hf models; a command of this plugin (``relax_register_commands``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relax_core import ConfigError, main

NAME = "demo"
HELP = "Run three RL steps on tiny CPU models: relax run on the embedded default job."

__all__ = ["DEMO_JOB", "DEMO_MODELS", "make_demo_models"]

#: The tiny models the job names (``tiny/<name>`` next to the job file) and their seeds.
DEMO_MODELS = {"policy": 0, "judge": 1, "math": 2}

#: The embedded default job (``docs/examples/run-cpu.toml`` holds the same text).
DEMO_JOB = """\
# relax run on one machine with no GPU: three tiny hf models on CPU in a defer layout with one
# declared GPU (the planner places every role on it; each engine is told --device cpu).
# Rollout generates through smg; genrm judges and teacher prefills in deferred phases on the
# same GPU; a trainer actor trains the policy on each committed batch and pushes its weights
# back. Make the models first (relative paths are relative to this file):
#
#   for m in policy:0 judge:1 math:2; do
#     relax-hf make-tiny-model docs/examples/tiny/${m%:*} --seed ${m#*:}
#   done
#   relax run docs/examples/run-cpu.toml --steps 3
#
# docs/run.md explains every [run] key.

[cluster]
num_nodes = 1
gpus_per_node = 1

[training]
actor_gpus = 1
colocate = true
offload = true

[placement]
mode = "defer"
defer_roles = ["genrm", "teacher"]

[roles.rollout.models.policy]
backend = "hf"
model_path = "tiny/policy"
weight_source = "ACTOR"
weights_cpu_backup = false
extra_args = ["--device", "cpu"]

[roles.genrm.models.judge]
backend = "hf"
model_path = "tiny/judge"
offload_weights = false
extra_args = ["--device", "cpu"]

[roles.teacher.models.math]
backend = "hf"
model_path = "tiny/math"
offload_weights = false
extra_args = ["--device", "cpu"]

[run]
steps = 3
dataset = "arithmetic"
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 16
rewards = [
  { adapter = "genrm-judge", weight = 1.0 },
  { adapter = "exact-match", weight = 0.5 },
  { adapter = "digits", weight = 0.5 },
]
reward_role = "genrm"
teacher_role = "teacher"
teacher_mode = "top-k"
top_k = 4
distill_coef = 0.1
learning_rate = 1e-4
seed = 0
"""


def make_demo_models(root: Path) -> None:
    """Make the tiny models :data:`DEMO_JOB` names under ``root``, in parallel, each by a
    ``python -m relax_hf make-tiny-model`` process.

    :raises ConfigError: a model could not be made (relax-hf missing, its error quoted).
    """
    make = [sys.executable, "-m", "relax_hf", "make-tiny-model"]
    procs = {
        name: subprocess.Popen(
            [*make, str(root / name), "--seed", f"{seed}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, seed in DEMO_MODELS.items()
    }
    problems = []
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            problems.append(f"{name}: {err.strip()[-400:]}")
    if problems:
        raise ConfigError(
            "relax demo",
            "making the tiny models failed:\n  " + "\n  ".join(problems),
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3, help="steps to run (default 3)")
    parser.add_argument("--json", action="store_true", help="JSON lines, as relax run --json")
    parser.add_argument("--trace", metavar="FILE", help="write the Perfetto trace of the run")
    parser.add_argument(
        "--print-job", action="store_true", help="print the embedded job file and exit"
    )


def run(args: argparse.Namespace) -> int:
    if args.print_job:
        print(DEMO_JOB, end="")
        return 0
    began = time.monotonic()
    out = sys.stderr if args.json else sys.stdout
    print(
        "relax demo: relax run on the embedded default job (docs/examples/run-cpu.toml): "
        "rollout, genrm and teacher on tiny CPU models, no GPU, no downloads",
        file=out,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="relax-demo-") as tmp:
        root = Path(tmp)
        print(f"  making three tiny models: {', '.join(DEMO_MODELS)} …", file=out, flush=True)
        make_demo_models(root / "tiny")
        job = root / "job.toml"
        job.write_text(DEMO_JOB)
        argv = ["run", str(job), "--steps", str(args.steps), "--log-dir", str(root / "logs")]
        argv += ["--json"] if args.json else []
        argv += ["--trace", args.trace] if args.trace else []
        status = main(argv)
    print(
        f"relax demo: done in {time.monotonic() - began:.0f}s (exit status {status})",
        file=out,
        flush=True,
    )
    return status
