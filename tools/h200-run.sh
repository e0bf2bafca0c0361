#!/usr/bin/env bash
# The H200 measurement of `relax run` (docs/run.md, "Measured on one H200"), on the GPU
# machine, from the repository root, with .whl/ made by tools/h200-wheels.sh beside it:
#
#   bash tools/h200-run.sh
#
# Installs the wheels into /tmp/site, makes the three ~0.5B random models, runs
# `relax run docs/examples/run-h200.toml --json --measure --trace …` and prints each step and
# the switch report. Files go to $OUT (default /tmp/relax-h200): h200.jsonl (the JSON lines),
# h200.log (progress and engine-independent messages), h200.trace.json (Perfetto), env.txt.
# About 3-4 minutes; if the CUDA IPC weight push fails, it runs again pushing safetensors.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/relax-h200}
# shellcheck source=tools/h200-setup.sh
source tools/h200-setup.sh

run() {
  python3 -m relax_core run "$1" --json --measure --trace "$OUT/h200.trace.json" \
    --log-dir "$OUT/engine-logs" >"$OUT/h200.jsonl" 2>"$OUT/h200.log"
}
run docs/examples/run-h200.toml
status=$?
if [ $status -ne 0 ] && grep -q "weight push" "$OUT/h200.log"; then
  echo "the CUDA IPC weight push failed; running again with push_format = safetensors"
  cp "$OUT/h200.log" "$OUT/h200-ipc.log"
  sed 's/^push_format = "ipc"/push_format = "safetensors"/' docs/examples/run-h200.toml \
    >docs/examples/run-h200-safetensors.toml
  run docs/examples/run-h200-safetensors.toml
  status=$?
fi
grep -v '^  · ' "$OUT/h200.log" | tail -n 40
python3 - "$OUT/h200.jsonl" <<'EOF'
import json, sys, time
from relax_core.run.progress import Printer
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
printer = Printer(tty=False)
for row in rows:
    if "reward_mean" in row:
        printer.step(row)
if rows and rows[-1].get("summary"):
    summary = rows[-1]
    # The printer counts the wall time from when it began: begin it as long ago as the run's
    # own wall time, so the replayed line says the run's seconds (not this script's, ~0).
    wall = summary.get("wall_seconds") or 0.0
    Printer(tty=False, began=time.monotonic() - wall).summary(summary)
    s = summary.get("switching") or {}
    print(json.dumps({k: s.get(k) for k in ("switch_seconds", "step_seconds", "share_of_step",
                                            "all_within_limit", "min_freed_fraction")}))
EOF
echo "relax run exited $status; $(( $(date +%s) - began ))s in all; files in $OUT"
exit $status
