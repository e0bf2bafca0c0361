# Sourced by tools/h200-run.sh and tools/h200-serve.sh (from the repository root, with $OUT
# set): installs .whl/ (made by tools/h200-wheels.sh) into /tmp/site, exports the environment
# the runs need, writes what the machine has to $OUT/env.txt, and makes the three ~0.5B random
# models of docs/examples/run-h200.toml. Sets $began (epoch seconds) for the caller's timing.
mkdir -p "$OUT"
began=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  python3 -c 'import sys, torch, transformers, ray; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0)); print("transformers", transformers.__version__, "ray", ray.__version__)'
  nproc; free -g
} 2>&1 | tee "$OUT/env.txt"
for m in policy:0 judge:1 math:2; do
  python3 -m relax_hf make-tiny-model "docs/examples/small/${m%:*}" --seed "${m#*:}" \
    --size small --dtype bfloat16 >/dev/null &
done
wait
echo "models made in $(( $(date +%s) - began ))s"
