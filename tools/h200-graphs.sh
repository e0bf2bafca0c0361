#!/usr/bin/env bash
# Decode CUDA graphs kept across switches, on one H200 (docs/benchmarks.md, "CUDA graphs across
# switches"), on the GPU machine, from the repository root, with .whl/ made by
# tools/h200-wheels.sh beside it (plus pytest, pytest-timeout and iniconfig wheels for the
# CUDA tests):
#
#   bash tools/h200-graphs.sh
#
# Runs the hf engine's CUDA tests, then docs/examples/run-h200.toml (graphs on) and the same job
# with --disable-cuda-graph (eager), back to back, and prints each one's steps, its sync step
# seconds and the ratio, and what the engines logged at each switch (graphs held, captures,
# replays). Files go to $OUT (default /tmp/relax-h200-graphs). About 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/relax-h200-graphs}
# shellcheck source=tools/h200-setup.sh
source tools/h200-setup.sh
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider \
    plugins/relax-hf/tests/test_cuda.py >"$OUT/test_cuda.txt" 2>&1
  echo "test_cuda.py exited $?"; tail -n 5 "$OUT/test_cuda.txt"
fi
eager=docs/examples/relax-bench-eager.toml
trap 'rm -f "$eager"' EXIT
sed 's/^extra_args = \["--memory-handoff"\]/extra_args = ["--disable-cuda-graph", "--memory-handoff"]/' \
  docs/examples/run-h200.toml >"$eager"
status=0
for mode in ${MODES:-graphs eager}; do
  job=docs/examples/run-h200.toml
  [ "$mode" = eager ] && job=$eager
  timeout "${RUN_TIMEOUT:-260}" python3 -m relax_core run "$job" --json --measure \
    --log-dir "$OUT/logs-$mode" >"$OUT/$mode.jsonl" 2>"$OUT/$mode.log" || status=$?
  grep -rh "relax-hf: \(release\|resume\|CUDA graphs\)" "$OUT"/logs-"$mode"/* 2>/dev/null \
    | sort | uniq -c | sort -rn | head -n 12 >"$OUT/$mode-switches.txt"
  echo "== $mode: relax run exited $status"; cat "$OUT/$mode-switches.txt"
done
python3 - "$OUT/graphs.jsonl" "$OUT/eager.jsonl" <<'PY' | tee "$OUT/summary-${MODES:-all}.json"
import json, sys
out = {}
for mode, path in zip(("graphs", "eager"), sys.argv[1:]):
    try:
        rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    except OSError:
        continue
    steps = [r for r in rows if "reward_mean" in r]
    summary = rows[-1] if rows and rows[-1].get("summary") else {}
    s = summary.get("switching") or {}
    out[mode] = {
        "steps": len(steps),
        "step_seconds": [round(r["seconds"], 2) for r in steps],
        "phases": [{k: round(v, 2) for k, v in r.get("phases", {}).items()} for r in steps],
        "switching": {k: s.get(k) for k in ("switch_seconds", "step_seconds", "share_of_step",
                                            "all_within_limit", "min_freed_fraction")},
        "switches": s.get("switches"),
    }
g = out.get("graphs", {}).get("step_seconds", [])
e = out.get("eager", {}).get("step_seconds", [])
n = min(len(g), len(e))
if n:
    out["graphs_vs_eager_step_seconds"] = sum(g[:n]) / sum(e[:n])
print(json.dumps(out))
PY
tar czf "$OUT/logs-${MODES:-all}.tgz" -C "$OUT" $(cd "$OUT" && ls -d logs-* 2>/dev/null)
rm -rf "$OUT"/logs-graphs "$OUT"/logs-eager
echo "done in $(( $(date +%s) - began ))s; files in $OUT"
exit $status
