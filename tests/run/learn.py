"""``nox -s learn``: the loop visibly learns (not part of the test suite), twice.

1. **A rule reward.** Makes the tiny policy (seed 0), runs ``relax run
   docs/examples/run-learn.toml --json`` (30 steps of 8 prompts x 8 samples on CPU, the
   ``digits`` rule reward, fixed seeds), prints the mean reward of every step, and fails unless
   the mean of the last five steps is clearly above the mean of the first five (by at least
   ``MARGIN``): committed batches reach the trainer and the trainer's weights reach rollout.
2. **The same, asynchronous.** ``docs/examples/run-learn-async.toml``: the same job with
   ``mode = "async"`` and ``max_staleness = 1``; the same margin.
3. **Distillation alone.** Makes a tiny teacher too (seed 2), runs
   ``docs/examples/run-learn-distill.toml`` (30 steps; the reward weighted 0, the teacher's
   top-8 from relax-teacher's ``distill`` stage), prints the trainer's KL to the teacher each
   step, and fails unless the mean of the last five steps is at most ``KL_RATIO`` of the first
   five's: the distillation stage's fields reach the trainer, and move the policy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
#: How far the last five steps' mean reward must end above the first five's.
MARGIN = 0.25
#: The largest share of the first five steps' mean KL the last five's may keep.
KL_RATIO = 0.5


def _run(job: str, models: Sequence[tuple[str, int]], key: str) -> tuple[list[float], int]:
    """``relax run`` of ``docs/examples/JOB`` with its tiny models; every committed step's
    ``key`` and the exit status."""
    with tempfile.TemporaryDirectory(prefix="relax-learn-") as tmp:
        root = Path(tmp)
        shutil.copy(EXAMPLES / job, root / "job.toml")
        for name, seed in models:
            target = str(root / "tiny" / name)
            subprocess.run(
                [sys.executable, "-m", "relax_hf", "make-tiny-model", target, "--seed", str(seed)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        out = subprocess.run(
            [sys.executable, "-m", "relax_core", "run", str(root / "job.toml"), "--json"],
            stdout=subprocess.PIPE,
            text=True,
            timeout=1800,
        )
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    values = [r[key] for r in rows if key in r and "event" not in r and r[key] is not None]
    return values, out.returncode


def _means(values: list[float]) -> tuple[float, float]:
    return sum(values[:5]) / 5, sum(values[-5:]) / 5


def learns_the_reward(job: str = "run-learn.toml") -> bool:
    print(f"learn: {job}")
    rewards, code = _run(job, [("policy", 0)], "reward_mean")
    for i, r in enumerate(rewards):
        print(f"step {i:2d}  reward {r:.3f}  {'#' * round(40 * r)}")
    if code != 0 or len(rewards) < 10:
        print(f"learn: relax run exited {code} after {len(rewards)} steps", file=sys.stderr)
        return False
    first, last = _means(rewards)
    ok = last >= first + MARGIN
    print(
        f"learn: mean reward of the first five steps {first:.3f}, of the last five {last:.3f} "
        f"({'clearly above' if ok else 'NOT clearly above'}: margin {MARGIN})"
    )
    return ok


def learns_the_teacher() -> bool:
    kls, code = _run("run-learn-distill.toml", [("policy", 0), ("math", 2)], "teacher_kl")
    top = max(kls, default=1.0) or 1.0
    for i, kl in enumerate(kls):
        print(f"step {i:2d}  KL to the teacher {kl:.4f}  {'#' * round(40 * kl / top)}")
    if code != 0 or len(kls) < 10:
        print(f"learn: relax run exited {code} after {len(kls)} steps", file=sys.stderr)
        return False
    first, last = _means(kls)
    ok = last <= KL_RATIO * first
    print(
        f"learn: mean KL to the teacher of the first five steps {first:.4f}, of the last five "
        f"{last:.4f} ({'clearly below' if ok else 'NOT clearly below'}: at most {KL_RATIO} of "
        "the first)"
    )
    return ok


def main() -> int:
    began = time.monotonic()
    reward = learns_the_reward()
    asynchronous = learns_the_reward("run-learn-async.toml")
    teacher = learns_the_teacher()
    print(f"learn: {time.monotonic() - began:.0f}s in all")
    return 0 if reward and asynchronous and teacher else 1


if __name__ == "__main__":
    sys.exit(main())
