#!/usr/bin/env bash
# The H200 measurement of on-demand wake under `relax serve` (docs/benchmarks.md, "On-demand
# wake under relax serve on one H200"), on the GPU machine, from the repository root, with .whl/
# made by tools/h200-wheels.sh beside it:
#
#   bash tools/h200-serve.sh
#
# Installs the wheels into /tmp/site, makes the three ~0.5B random models, times one pinned
# host-to-device copy of one model's weight bytes (the baseline), then runs
# `relax bench wake --job docs/examples/run-h200.toml --json` (relax serve of the job: three hf
# engines on the one GPU in a defer layout with --memory-handoff, woken on demand) and prints
# its report beside the copy. Files go to $OUT (default /tmp/relax-h200-serve): wake.json,
# copy.json, wake.log, env.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/relax-h200-serve}
# shellcheck source=tools/h200-setup.sh
source tools/h200-setup.sh
python3 - "$OUT/copy.json" <<'PY'
import json, sys
from pathlib import Path
from relax_hf.gpu_bench import _h2d_baseline
nbytes = sum(p.stat().st_size for p in Path("docs/examples/small/judge").glob("*.safetensors"))
seconds = _h2d_baseline(nbytes, "cuda:0", repeats=5)
row = {"weight_bytes": nbytes, "pinned_h2d_ms": round(seconds * 1e3, 2),
       "gb_per_s": round(nbytes / seconds / 1e9, 1)}
print("pinned copy of one model's weights:", json.dumps(row))
json.dump(row, open(sys.argv[1], "w"))
PY
python3 -m relax_core bench wake --job docs/examples/run-h200.toml --json \
  >"$OUT/wake.json" 2>"$OUT/wake.log"
status=$?
tail -n 20 "$OUT/wake.log"
python3 - "$OUT/wake.json" "$OUT/copy.json" <<'PY'
import json, sys
from relax_bench.wake import format_result
text = open(sys.argv[1]).read().strip()
if text:
    result = json.loads(text.splitlines()[-1])
    copy = json.load(open(sys.argv[2]))
    print(format_result(result))
    print(f"pinned copy of the weights: {copy['pinned_h2d_ms']} ms ({copy['gb_per_s']} GB/s); "
          f"wake cost p50 / copy: {result['wake_cost_p50_ms'] / copy['pinned_h2d_ms']:.2f}")
PY
echo "relax bench wake exited $status; $(( $(date +%s) - began ))s in all; files in $OUT"
exit $status
