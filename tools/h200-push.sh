#!/usr/bin/env bash
# The bucketed weight push on one GPU (docs/hf-engine.md, "Weight updates"), on the GPU machine,
# from the repository root, with .whl/ made by tools/h200-wheels.sh beside it:
#
#   bash tools/h200-push.sh
#
# Installs the wheels into /tmp/site, makes the ~0.9 GB small model (bfloat16), starts one hf
# engine on GPU 0 and pushes the model's own weights into it over CUDA IPC, SGLang's
# flattened_bucket (one flat buffer and one IPC handle per bucket), for buckets of 64 MiB,
# 256 MiB, 512 MiB, 1 GiB and the whole model, three pushes each; in the same run it times a
# pinned host-to-device copy and a device-to-device copy of the same bytes
# (`relax-hf push-bench --json`). Files go to $OUT (default /tmp/relax-h200-push): push.json
# (the result), push.log (progress), push-bench-engine.log, env.txt. About 2 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/relax-h200-push}
mkdir -p "$OUT"
began=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  python3 -c 'import sys, torch, transformers; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0)); print("transformers", transformers.__version__)'
  nproc; free -g
} 2>&1 | tee "$OUT/env.txt"
MODEL="$OUT/small"
python3 -m relax_hf make-tiny-model "$MODEL" --size small --dtype bfloat16 >/dev/null || exit 1
echo "model made in $(( $(date +%s) - began ))s"
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python3 -m relax_hf push-bench "$MODEL" \
  --device cuda --bucket-mib 64 256 512 1024 0 --repeats 3 --log-dir "$OUT" --json \
  >"$OUT/push.json" 2>"$OUT/push.log"
status=$?
tail -n 20 "$OUT/push.log"
python3 - "$OUT/push.json" <<'PY'
import json, sys
from relax_hf.push_bench import format_result
text = open(sys.argv[1]).read().strip()
if text:
    print(format_result(json.loads(text.splitlines()[-1])))
PY
echo "push-bench exited $status; $(( $(date +%s) - began ))s in all; files in $OUT"
exit $status
