#!/usr/bin/env bash
# Multi-GPU acceptance of tensor / expert parallelism (issue 19): ONE device call on nvidia-h200-x2 (run with
# timeout_s 600; worst case, every stage hitting its own timeout, ~8 min). Each stage has its own timeout and
# leaves its stage logs and the Python stacks of every rank when it hangs (LINRNN_TP_HANG_S without progress
# dumps them; `timeout`'s SIGTERM does too), so a hang in one stage still reports the others. Prints each
# stage's table as it finishes, then a summary; everything (logs, per-rank stage logs and stacks, JSON) in
# $OUT/gpu_tp.tgz, the printed report in $OUT/gpu_tp.txt.
#   a. NCCL: all-reduce bus bandwidth to 64 MB, then an all-reduce + all-gather captured in one CUDA graph through
#      torch.distributed and replayed (what the decode graphs rely on; tools/nccl_probe.py --graph)
#   b. 35B-A3B NVFP4 dummy: greedy streams and logits of TP2 eager, TP2 and EP2 vs TP1 on a fixed prompt set
#      (8 prompts x 24 tokens; logits within 2x the one-ulp noise floor tp1p; tools/tp_compare.py --check-floor)
#   c. bench batched TP1 / TP2 / EP2, same model: S_TG at npl 1, 8, 32, 128 (PP 128, TG 32), with the per-step
#      communication time and the all-reduce bandwidth beside a's bus bandwidth (tools/tp_comm_summary.py)
#   d. 122B-A10B NVFP4 dummy served at TP 2: health, one completion, bench serve at concurrency 1 and 16
# With 4 GPUs: GPU_TP_397B=1 adds e. the 397B-A17B NVFP4 dummy served at TP 4 (longer than 8 min in all).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; L=/tmp/gpu_tp; rm -rf "$L"; mkdir -p "$L" "$OUT"
export LINRNN_TP_HANG_S=${LINRNN_TP_HANG_S:-60} PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
exec > >(tee "$OUT/gpu_tp.txt") 2>&1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
el "$NGPU GPUs; NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}; hang watch ${LINRNN_TP_HANG_S} s"
nvidia-smi topo -m 2>/dev/null | head -4
if [ "$NGPU" -lt 2 ]; then echo "needs 2 or more GPUs: blocked"; exit 2; fi
declare -A RC SECS
stage() {  # name timeout cmd...: own timeout (SIGTERM to the group: every rank dumps its stacks), status kept
  local name=$1 t=$2; shift 2
  mkdir -p "$L/$name/ranks"; export LINRNN_TP_DUMP_DIR=$L/$name/ranks
  el "== $name (timeout $t s)"
  local s=$(date +%s)
  timeout -k 10 "$t" "$@" > "$L/$name/log" 2>&1; RC[$name]=$?
  SECS[$name]=$(( $(date +%s) - s ))
  el "$name: exit ${RC[$name]} after ${SECS[$name]} s"
}
why() {  # a failed stage: each rank's last stage line, the top of its stacks, the log's errors
  local name=$1
  for f in "$L/$name"/ranks/rank*.log; do [ -f "$f" ] && echo "  $(basename "$f"): $(tail -n 1 "$f")"; done
  for f in "$L/$name"/ranks/rank*.stacks; do  # the last dump of each rank: threads, innermost call first
    [ -s "$f" ] && { echo "  --- $(basename "$f")"; grep -E "^====|^Current thread|^Thread|File" "$f" | tail -n 24; }
  done
  grep -E "Error|error|HANG|no progress|Watchdog|NCCL WARN|timed out|TIMEOUT|FAILED" "$L/$name/log" | head -12
}

# ---- a. NCCL probe --------------------------------------------------------------------------------------
stage a_nccl 40 python3 -m tools.nccl_probe --ranks 2 --max-bytes $((64 << 20)) --iters 10 --graph \
  --out "$L/a_nccl/nccl_probe.json"
grep "^|\|^all-reduce" "$L/a_nccl/log"

# ---- b. greedy TP2 eager / TP2 / EP2 vs TP1 ---------------------------------------------------------------
stage b_compare 230 python3 -m tools.tp_compare --model qwen35moe-nvfp4 --load-format dummy --device cuda \
  --configs tp1,tp1p,tp2e,tp2,ep2 --num-prompts 8 --max-tokens 24 --timeout 90 --check-floor 2 --out "$L/b_compare"
grep -E "^\||exit status|ready in|TIMEOUT|CHECK" "$L/b_compare/log"

# ---- c. bench batched TP1 / TP2 / EP2 ---------------------------------------------------------------------
M="model=qwen35moe-nvfp4,load-format=dummy"
stage c_batched 130 python3 -m linrnn_serve bench batched --npp 128 --ntg 32 --npl 1,8,32,128 --no-progress \
  --config "$M,label=TP1" --config "$M,tp=2,label=TP2" --config "$M,tp=2,ep=true,label=EP2" --out "$L/c_batched/batched"
grep -E "^\||^## |^Comm|FAILED|engine ready" "$L/c_batched/log"
python3 -m tools.tp_comm_summary "$L/c_batched/batched/batched.json" "$L/a_nccl/nccl_probe.json" 2>&1 | head -20

# ---- d. 122B-A10B NVFP4 dummy served at TP 2 --------------------------------------------------------------
serve_check() {  # model tp port extra-flags...: start, health, one completion, bench serve c=1,16, stop
  local model=$1 tp=$2 port=$3; shift 3
  python3 -m linrnn_serve --model "$model" --load-format dummy -tp "$tp" "$@" --host 127.0.0.1 --port "$port" \
    --max-num-seqs 16 --max-model-len 1024 &
  local srv=$! ok=0
  for i in $(seq 1 600); do
    curl -sf "127.0.0.1:$port/health" >/dev/null && { ok=1; break; }
    kill -0 $srv 2>/dev/null || break; sleep 0.5
  done
  echo "server healthy: $ok after $i polls"
  if [ $ok = 1 ]; then
    curl -sS --max-time 30 "127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"$model\", \"prompt\": \"Hello\", \"max_tokens\": 16, \"temperature\": 0}" | head -c 600; echo
    python3 -m linrnn_serve bench serve --base-url "http://127.0.0.1:$port" --input-len 128 --output-len 32 \
      --max-concurrency 1,16 --num-prompts 16 --out "$L/serve_${model}.json"
  fi
  kill -INT $srv; wait $srv; echo "server exit status $?"
  [ $ok = 1 ]
}
export -f serve_check; export L
stage d_serve_122b 120 bash -c 'serve_check qwen35moe-122b-nvfp4 2 8019'
grep -E "^\||server |tensor parallel|caches:|weights|\"text\"|choices" "$L/d_serve_122b/log" | head -20

if [ "$NGPU" -ge 4 ] && [ "${GPU_TP_397B:-0}" = 1 ]; then
  stage e_serve_397b 400 bash -c 'serve_check qwen35moe-397b-nvfp4 4 8020'
  grep -E "^\||server |tensor parallel|caches:|weights" "$L/e_serve_397b/log" | head -20
fi

# ---- summary -----------------------------------------------------------------------------------------------
echo; echo "| stage | exit | seconds |"; echo "|---|---:|---:|"
for n in a_nccl b_compare c_batched d_serve_122b e_serve_397b; do
  [ -n "${RC[$n]}" ] && echo "| $n | ${RC[$n]} | ${SECS[$n]} |"
done
for n in a_nccl b_compare c_batched d_serve_122b e_serve_397b; do
  if [ -n "${RC[$n]}" ] && [ "${RC[$n]}" != 0 ]; then echo "-- $n failed:"; why $n; fi
done
tar czf "$OUT/gpu_tp.tgz" -C /tmp gpu_tp 2>/dev/null
el "done"
