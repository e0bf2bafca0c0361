#!/usr/bin/env bash
# The hf engine's decode before and after a change, back to back on one GPU machine, from the
# repository root, with .whl/ made by tools/h200-wheels.sh at the change and the hf engine's
# wheel of the code before it in .whl/old/:
#
#   bash tools/h200-hf-ab.sh
#
# Runs `relax-hf gpu-bench --json` ROUNDS times (default 2) for each, alternating (before,
# after, before, after: the machine's drift falls on both), then tools/gather-probe.py and
# the engine's CUDA tests (TESTS=0 leaves them out; they need pytest's wheels in .whl/), and
# prints each run's c1 / c16 / c64 tokens/s and the after-over-before ratios of their medians.
# Files go to $OUT (default /tmp/relax-h200-hf-ab).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/relax-h200-hf-ab}
# shellcheck source=tools/h200-setup.sh
source tools/h200-setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-old .whl/old/*.whl || exit 1
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in before after; do
    path=/tmp/site
    [ "$side" = before ] && path=/tmp/site-old:/tmp/site
    PYTHONPATH=$path timeout "${BENCH_TIMEOUT:-150}" python3 -m relax_hf gpu-bench --json \
      >"$OUT/gpu-bench-$side-$round.json" 2>"$OUT/gpu-bench-$side-$round.log"
    echo "gpu-bench $side $round exited $? at $(( $(date +%s) - began ))s"
  done
done
timeout 120 python3 tools/gather-probe.py >"$OUT/gather-probe.jsonl" 2>&1
echo "gather-probe exited $?"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider \
    plugins/relax-hf/tests/test_cuda.py >"$OUT/test_cuda.txt" 2>&1
  code=$?
  echo "test_cuda.py exited $code"
  # A failure's whole story on stdout (a remote runner may bring back only a few files).
  if [ "$code" = 0 ]; then tail -n 5 "$OUT/test_cuda.txt"; else tail -n 120 "$OUT/test_cuda.txt"; fi
fi
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {"before": [], "after": []}
for side in rows:
    for f in sorted(out.glob(f"gpu-bench-{side}-*.json")):
        try:
            dec = json.loads(f.read_text())["decode"]
        except (ValueError, KeyError):
            print(f.name, "no result"); continue
        row = {k: dec.get(f"{k}_tokens_per_s") for k in ("c1", "c16", "c64")}
        row["c1_over_roofline"] = dec.get("c1_over_roofline")
        rows[side].append(row)
        print(side, f.name, json.dumps(row))
summary = {}
for k in ("c1", "c16", "c64", "c1_over_roofline"):
    b = [r[k] for r in rows["before"] if r.get(k)]
    a = [r[k] for r in rows["after"] if r.get(k)]
    if a and b:
        summary[k] = {"before": statistics.median(b), "after": statistics.median(a),
                      "ratio": round(statistics.median(a) / statistics.median(b), 3)}
print(json.dumps({"ab": summary}))
PY
