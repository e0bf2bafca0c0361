#!/usr/bin/env bash
# Issue 34's measurements on one H200, in one session of at most ~9 minutes (BUDGET seconds,
# default 540), on the GPU machine, from the repository root, with .whl/ made by
# tools/h200-wheels.sh beside it:
#
#   bash tools/h200-issue34.sh
#
# In order (each bounded by what is left of the budget; what does not fit is skipped and says so
# in the summary):
#   1. docs/examples/run-h200.toml with CUDA graphs, 5 steps, --measure: each switch against
#      1.25 x the pinned copy of its bytes + 15 ms, the decode graphs captured during each switch
#      (the engines' /server_info counters around it), each step's generate and genrm phases'
#      tokens/s (their engines' generation counters over the phase's seconds), and the run's
#      trace (trace.json): how much of the switching no other phase overlapped;
#   2. relax-hf engine-throughput on the policy and the judge model alone, at the shapes the
#      run's phases had (256 in flight; their mean prompt and new tokens): the phases' tokens/s
#      over the engine's own;
#   3. relax bench wake --job docs/examples/run-h200.toml: wake cost p50 / p99 against one pinned
#      copy of a model's weights;
#   4. relax-hf gpu-bench: decode at concurrency 1 against the weight-bandwidth roofline
#      (PARTS=gpu-bench-off, not in the default: the same with the overlapped schedule off;
#      PARTS=gpu-bench-compile: with --torch-compile);
#   5. docs/examples/run-h200-async.toml (graphs) back to back up to ASYNC_RUNS times (default 5),
#      each checked for every step committed;
#   6. (PARTS=profile, not in the default) tools/decode-profile.py: one decode step's kernels at
#      batch 1 and 64 (graph replay, eager, launches and GPU time per kernel, the sampler eager
#      and compiled, the whole step compiled), as decode-profile.json;
#   6b. (PARTS=vmm, not in the default) tools/vmm-probe.py --handover-only at each bulk chunk
#      size of VMM_CHUNKS (default "1 8" GiB), a pool of VMM_POOL_GB (default 84), as vmm-*.jsonl;
#   7. (PARTS=judge-paths, not in the default) tools/judge-paths.py on the judge model, the
#      engine with --num-continuous-decode-steps 1 and then JUDGE_CONTINUOUS_AB (default 4;
#      empty: 1 alone), JUDGE_CONCURRENCY (default 256) in flight: the reward stage's requests
#      against the random ones, prefill steps and tokens/s of each (JUDGE_PATHS_HANDOFF=1: the
#      engine with --memory-handoff, released and resumed once after its warm-up;
#      JUDGE_PATHS_MEM: its --mem-fraction-static, default 0.6; JUDGE_PATHS_COLD=1: each round
#      starts with the prefix cache empty, as a run's judge phase does; JUDGE_PATHS_LONGER=3:
#      prompts as long as the run's, ~210 tokens).
# JUDGE_CONTINUOUS=N (default 1): the judge's engine in parts 1 and 2 takes
# --num-continuous-decode-steps N (part 1 runs a copy of run-h200.toml with that engine option).
# Files go to $OUT (default /tmp/relax-h200-issue34): summary.json (everything above), each
# part's JSON lines and logs, engine logs as logs.tgz. DRY=1 writes the plan and stops (no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/relax-h200-issue34}
BUDGET=${BUDGET:-540}
ASYNC_RUNS=${ASYNC_RUNS:-5}
# PARTS: which of run, throughput, wake, gpu-bench, async to run (default all; e.g. PARTS="wake
# gpu-bench" in a second session when one session's budget cannot hold them all).
PARTS=${PARTS:-run throughput wake gpu-bench async}
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
mkdir -p "$OUT"
if [ "${DRY:-0}" = 1 ]; then
  began=$(date +%s)
  echo "plan: run-h200 graphs, engine-throughput x2, gpu-bench, bench wake, async x$ASYNC_RUNS" \
    "within ${BUDGET}s; files in $OUT" | tee "$OUT/plan.txt"
  exit 0
fi
# shellcheck source=tools/h200-setup.sh
source tools/h200-setup.sh
# GCPROBE=1 (the default): every Python process logs its garbage-collection pauses of 5 ms or
# more to $OUT/gc.jsonl (tools/gcprobe), and each part's start and end go to $OUT/parts.txt;
# the summary counts the pauses of each part.
if [ "${GCPROBE:-1}" = 1 ]; then
  export PYTHONPATH="$PWD/tools/gcprobe:$PYTHONPATH" GC_PROBE_LOG="$OUT/gc.jsonl"
fi

left() { echo $(( BUDGET - ($(date +%s) - began) )); }
# bounded SECONDS_WANTED NAME CMD...: run CMD with the time left (at most SECONDS_WANTED), or
# skip it (noted in $OUT/skipped.txt) when less than a third of that is left.
bounded() {
  local want=$1 name=$2
  shift 2
  local t
  t=$(left)
  if [ "$t" -lt $(( want / 3 )) ]; then
    echo "$name: skipped, ${t}s left of ${BUDGET}s" | tee -a "$OUT/skipped.txt"
    return 99
  fi
  [ "$t" -gt "$want" ] && t=$want
  echo "== $name (up to ${t}s; $(( $(date +%s) - began ))s in)"
  echo "$name	$(date +%s.%N)	start" >>"$OUT/parts.txt"
  timeout -s INT -k 30 "$t" "$@"  # SIGINT: relax run and serve stop as on Ctrl-C
  local code=$?
  echo "$name	$(date +%s.%N)	end" >>"$OUT/parts.txt"
  return $code
}

# PYSPY=1 (py-spy's wheel in .whl/): py-spy records each engine and the run's driver while part 1
# runs (100 samples/s, idle samples and threads kept) into $OUT/spy-<pid>.txt, collapsed stacks:
# where a phase's engine spends its steps and whether it waits for requests. PYSPY_ARGS adds
# py-spy options (e.g. PYSPY_ARGS=--gil: only the thread holding the GIL, to see which of an
# engine's threads the compute thread waits for).
spy() {
  local jsonl=$1 pids p
  for _ in $(seq 1 240); do grep -q engine_pids "$jsonl" 2>/dev/null && break; sleep 1; done
  pids=$(python3 -c 'import json, sys
for line in open(sys.argv[1]):
    if "engine_pids" in line: print(*json.loads(line)["engine_pids"])' "$jsonl")
  pids="$pids $(pgrep -f "^python3 -m relax_core run $RUN_TOML" | head -n 1)"
  for p in $pids; do
    # shellcheck disable=SC2086  # PYSPY_ARGS: words
    /tmp/site/bin/py-spy record -p "$p" -r 100 --idle --threads -f raw -d 400 --nonblocking \
      ${PYSPY_ARGS:-} -o "$OUT/spy-$p.txt" >"$OUT/spy-$p.log" 2>&1 &
  done
  echo "py-spy on $pids" >"$OUT/spy.txt"
  for p in $pids; do echo "$p: $(ps -o args= -p "$p" | cut -c1-200)" >>"$OUT/spy.txt"; done
}

# 1. run-h200.toml with graphs.
# RUN_TOML=...: another job instead, for parts 1 and 3 (e.g. a copy sized for an 80 GB GPU,
# beside the original).
JOB=${RUN_TOML:-docs/examples/run-h200.toml}
RUN_TOML=$JOB
if [ "${JUDGE_CONTINUOUS:-1}" != 1 ]; then
  # A copy beside the original (its model paths are relative to its folder), git-ignored.
  RUN_TOML=docs/examples/run-h200-judge-continuous.toml
  cp "$JOB" "$RUN_TOML"
  printf '\n[roles.genrm.models.judge.engine]\nnum_continuous_decode_steps = %s\n' \
    "$JUDGE_CONTINUOUS" >>"$RUN_TOML"
fi
if want run; then
  [ "${PYSPY:-0}" = 1 ] && { rm -f "$OUT/graphs.jsonl"; spy "$OUT/graphs.jsonl" & }
  bounded 220 run-h200 python3 -m relax_core run "$RUN_TOML" --json --measure \
    --trace "$OUT/trace.json" --log-dir "$OUT/logs-graphs" >"$OUT/graphs.jsonl" \
    2>"$OUT/graphs.log"
  echo "run-h200 exited $?"; grep -v '^  · ' "$OUT/graphs.log" | tail -n 8
fi

# 2. The engines' own throughput at the phases' shapes (read off the run's counters).
python3 - "$OUT/graphs.jsonl" >"$OUT/shapes.env" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
summary = rows[-1] if rows and rows[-1].get("summary") else {}
sw = (summary.get("switching") or {}).get("switches") or []
steps = [r for r in rows if "reward_mean" in r]
def shape(role):
    gen = pre = n = 0
    for s in steps:
        on = [w for w in sw if w["role"] == role and w["direction"] == "onload" and w["step"] == s["step"]]
        off = [w for w in sw if w["role"] == role and w["direction"] == "offload" and w["step"] == s["step"]]
        if on and off:
            a, b = on[0]["counters_after"], off[0]["counters_before"]
            gen += b.get("generation_tokens_total", 0) - a.get("generation_tokens_total", 0)
            pre += b.get("prefill_tokens_total", 0) - a.get("prefill_tokens_total", 0)
            n += s.get("samples", 0)
    return (round(pre / n) if n else 64, round(gen / n) if n else 128)
for role, name in (("rollout", "ROLLOUT"), ("genrm", "JUDGE")):
    p, g = shape(role)
    print(f"{name}_PROMPT={max(1, p)}\n{name}_NEW={max(1, g)}")
PY
# SHAPES (lines NAME=VALUE) replaces what the run's counters gave, for a session without part 1.
[ -n "${SHAPES:-}" ] && printf '%b\n' "$SHAPES" >"$OUT/shapes.env"
# shellcheck disable=SC1091
source "$OUT/shapes.env"
# Each at the concurrency its phase has: the step's 256 samples in flight for rollout, and for
# the judge its reward stage's concurrency (256 in run-h200.toml; JUDGE_CONCURRENCY=64 for a job
# on the stage's default).
# --compare: the same engine, right after, with the requests as the phase sends them (rollout:
# n = 8 a prompt with return_logprob; the judge: prompts sharing a system prompt, and chat
# messages the engine renders), each over the random prompts (docs/benchmarks.md).
want throughput && for m in rollout:policy:"$ROLLOUT_PROMPT":"$ROLLOUT_NEW":1.0:256:rollout \
    genrm:judge:"$JUDGE_PROMPT":"$JUDGE_NEW":0.0:${JUDGE_CONCURRENCY:-256}:shared-prefix,chat; do
  IFS=: read -r role model prompt new temp conc compare <<<"$m"
  # THROUGHPUT_ROLES: which phases' engines to measure (default both; "genrm" alone when the
  # generation phase is known to be met and the session's budget is short).
  case " ${THROUGHPUT_ROLES:-rollout genrm} " in *" $role "*) ;; *) continue ;; esac
  bounded 130 "engine-throughput $role" python3 -m relax_hf engine-throughput \
    "docs/examples/small/$model" --json --concurrency "$conc" --requests 256 \
    --prompt-tokens "$prompt" --max-new-tokens "$new" --temperature "$temp" \
    --mem-fraction-static 0.6 --max-running-requests 256 --log-dir "$OUT/logs-throughput" \
    --compare "$compare" --num-continuous-decode-steps "$([ "$role" = genrm ] && echo \
    "${JUDGE_CONTINUOUS:-1}" || echo 1)" >"$OUT/throughput-$role.json" 2>"$OUT/throughput-$role.log"
  echo "engine-throughput $role exited $?"; tail -c 400 "$OUT/throughput-$role.json"; echo
done

# 3. Wake under relax serve, against one pinned copy of a model's weights.
python3 - "$OUT/copy.json" <<'PY'
import json, sys
from pathlib import Path
from relax_hf.gpu_bench import _h2d_baseline
nbytes = sum(p.stat().st_size for p in Path("docs/examples/small/judge").glob("*.safetensors"))
seconds = _h2d_baseline(nbytes, "cuda:0", repeats=5)
json.dump({"weight_bytes": nbytes, "pinned_h2d_ms": round(seconds * 1e3, 2)}, open(sys.argv[1], "w"))
PY
if want wake; then
  bounded 210 wake python3 -m relax_core bench wake --job "$JOB" --json \
    >"$OUT/wake.json" 2>"$OUT/wake.log"
  echo "bench wake exited $?"
fi

# 4. Single-stream decode against the roofline.
if want gpu-bench; then
  bounded 120 gpu-bench python3 -m relax_hf gpu-bench --json >"$OUT/gpu-bench.json" \
    2>"$OUT/gpu-bench.log"
  echo "gpu-bench exited $?"
fi
# 4b. (PARTS=gpu-bench-off, not in the default) the same with the overlapped schedule off, right
# after: the schedule's share of c1, back to back on one machine.
if want gpu-bench-off; then
  bounded 120 gpu-bench-off python3 -m relax_hf gpu-bench --json --disable-overlap-schedule \
    >"$OUT/gpu-bench-off.json" 2>"$OUT/gpu-bench-off.log"
  echo "gpu-bench-off exited $?"
fi

# 4c. (PARTS=gpu-bench-compile, not in the default) the same with --torch-compile (the decode
# step's element-wise pieces fused by torch.compile), right after: its ratio to the default.
if want gpu-bench-compile; then
  bounded 180 gpu-bench-compile python3 -m relax_hf gpu-bench --json --torch-compile \
    >"$OUT/gpu-bench-compile.json" 2>"$OUT/gpu-bench-compile.log"
  echo "gpu-bench-compile exited $?"
fi

# 6. Where a decode step's time goes (asked for by name: not in the default PARTS).
if want profile; then
  bounded 240 decode-profile python3 tools/decode-profile.py --whole-compile --batch 1 64 \
    --json "$OUT/decode-profile.json" >"$OUT/decode-profile.log" 2>&1
  echo "decode-profile exited $?"; grep -v '^ ' "$OUT/decode-profile.log" | tail -n 4
fi

# 6b. (PARTS=vmm, not in the default) the memory hand-over alone between two processes, a pool
# of VMM_POOL_GB (default 84, the run's) in chunks of 1 GiB and in the bulk chunks of
# VMM_CHUNKS (default "1 8" GiB): what a switch pays per chunk (tools/vmm-probe.py).
if want vmm; then
  for c in ${VMM_CHUNKS:-1 8}; do
    bounded 90 "vmm-probe ${c}GiB" python3 tools/vmm-probe.py --handover-only \
      --pool-gb "${VMM_POOL_GB:-84}" --chunk-gib "$c" --rounds 4 >"$OUT/vmm-$c.jsonl" 2>&1
    echo "vmm-probe ${c}GiB exited $?"
  done
fi

# 7. The judge's requests with and without admission every N steps (asked for by name).
if want judge-paths; then
  for n in 1 ${JUDGE_CONTINUOUS_AB-4}; do
    bounded 120 "judge-paths n=$n" python3 tools/judge-paths.py docs/examples/small/judge \
      --device cuda --mem-fraction-static "${JUDGE_PATHS_MEM:-0.6}" \
      --concurrency "${JUDGE_CONCURRENCY:-256}" --requests 256 --rounds 2 \
      --num-continuous-decode-steps "$n" ${JUDGE_PATHS_HANDOFF:+--memory-handoff} \
      ${JUDGE_PATHS_COLD:+--cold} --longer "${JUDGE_PATHS_LONGER:-0}" \
      --json >"$OUT/judge-paths-$n.json" \
      2>"$OUT/judge-paths-$n.log"
    echo "judge-paths n=$n exited $?"; tail -c 300 "$OUT/judge-paths-$n.json"; echo
  done
fi

# 5. The async job with graphs, back to back, while the budget lasts.
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
want async || ASYNC_RUNS=0
for i in $(seq 1 "$ASYNC_RUNS"); do
  bounded 240 "async run $i" python3 -m relax_core run docs/examples/run-h200-async.toml \
    --json --log-dir "$OUT/logs-async-$i" >"$OUT/async-$i.jsonl" 2>"$OUT/async-$i.log"
  code=$?
  echo "async run $i exited $code"
  [ $code -eq 99 ] && { rm -f "$OUT/async-$i.jsonl" "$OUT/async-$i.log"; break; }
done

python3 tools/h200_issue34_summary.py "$OUT" | tee "$OUT/summary.json"
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls -d logs-* 2>/dev/null) 2>/dev/null
rm -rf "$OUT"/logs-*
echo "done in $(( $(date +%s) - began ))s; files in $OUT"
