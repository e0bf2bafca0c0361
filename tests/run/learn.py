"""``nox -s learn``: the loop visibly learns (not part of the test suite).

Makes the tiny policy (seed 0), runs ``relax run docs/examples/run-learn.toml --json`` (30
steps of 8 prompts x 8 samples on CPU, the ``digits`` rule reward, fixed seeds), prints the
mean reward of every step, and exits 1 unless the mean of the last five steps is clearly above
the mean of the first five (by at least ``MARGIN``). This is the end-to-end proof that
committed batches reach the trainer and the trainer's weights reach rollout: the reward can
only rise if both happen every step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "run-learn.toml"
#: How far the last five steps' mean reward must end above the first five's.
MARGIN = 0.25


def main() -> int:
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relax-learn-") as tmp:
        root = Path(tmp)
        shutil.copy(EXAMPLE, root / "job.toml")
        subprocess.run(
            [sys.executable, "-m", "relax_hf", "make-tiny-model", str(root / "tiny" / "policy")],
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
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    for i, r in enumerate(rewards):
        print(f"step {i:2d}  reward {r:.3f}  {'#' * round(40 * r)}")
    if out.returncode != 0 or len(rewards) < 10:
        print(
            f"learn: relax run exited {out.returncode} after {len(rewards)} steps", file=sys.stderr
        )
        return 1
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    ok = last >= first + MARGIN
    print(
        f"learn: mean reward of the first five steps {first:.3f}, of the last five {last:.3f} "
        f"({'clearly above' if ok else 'NOT clearly above'}: margin {MARGIN}); "
        f"{time.monotonic() - began:.0f}s in all"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
