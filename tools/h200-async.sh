#!/usr/bin/env bash
# Asynchronous against synchronous steps of `relax run` on one H200 (docs/benchmarks.md,
# "Asynchronous steps"), on the GPU machine, from the repository root, with .whl/ made by
# tools/h200-wheels.sh beside it:
#
#   bash tools/h200-async.sh
#
# Runs docs/examples/run-h200-async.toml (split layout over three logical GPUs that are the one
# physical GPU, mode = "async", max_staleness = 1) and the same job with mode = "sync", one after
# the other in this session, and prints each one's steps per minute (the steps' own seconds:
# start-up aside) and the ratio. JOB=docs/examples/run-h200.toml does the same for the defer
# layout (rollout takes turns with genrm and teacher: async overlaps only training). Files go
# to $OUT (default /tmp/relax-h200-async).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/relax-h200-async}
# shellcheck source=tools/h200-setup.sh
source tools/h200-setup.sh
# Three logical GPUs, one physical: Ray must not hide the GPU from bundles 1 and 2.
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
JOB=${JOB:-docs/examples/run-h200-async.toml}
# Both jobs sit beside $JOB (its model paths are relative to the job file); the async keys go
# right under its [run] header (tables such as [[run.stages]] may follow it).
dir=$(dirname "$JOB")
trap 'rm -f "$dir/relax-bench-sync.toml" "$dir/relax-bench-async.toml"' EXIT
sed '/^mode = "async"$/d; /^max_staleness = /d' "$JOB" >"$dir/relax-bench-sync.toml"
sed '/^\[run\]$/a mode = "async"\nmax_staleness = 1' "$dir/relax-bench-sync.toml" \
  >"$dir/relax-bench-async.toml"
status=0
for mode in ${MODES:-sync async}; do
  python3 -m relax_core run "$dir/relax-bench-$mode.toml" --json --trace "$OUT/$mode.trace.json" \
    --log-dir "$OUT/engine-logs-$mode" >"$OUT/$mode.jsonl" 2>"$OUT/$mode.log" || status=$?
  grep -v '^  · ' "$OUT/$mode.log" | tail -n 20
done
python3 - "$OUT/sync.jsonl" "$OUT/async.jsonl" <<'PY'
import json, sys
out = {}
for mode, path in zip(("sync", "async"), sys.argv[1:]):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    steps = [r for r in rows if "reward_mean" in r]
    seconds = sum(r["seconds"] for r in steps)
    out[mode] = {
        "steps": len(steps),
        "step_seconds": seconds,
        "steps_per_minute": 60 * len(steps) / seconds if seconds else None,
        "max_staleness_seen": max((r.get("async", {}).get("max_staleness_seen", 0) for r in steps), default=None),
    }
if out["sync"]["steps_per_minute"] and out["async"]["steps_per_minute"]:
    out["async_vs_sync"] = out["async"]["steps_per_minute"] / out["sync"]["steps_per_minute"]
print(json.dumps(out))
PY
echo "relax run exited $status; $(( $(date +%s) - began ))s in all; files in $OUT"
exit $status
