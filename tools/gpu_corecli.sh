#!/usr/bin/env bash
# Issue #14 item 1 on one H200 (<= 5 min): `linrnn-serve` with the engine core in its own process (the
# default), 35B-A3B NVFP4 dummy, `bench serve` in 128 / out 128 at concurrency 1 and 64: TTFT / TPOT
# medians and output tok/s. Checks that the server really has a core child process, and reads the core's
# host time per decode step from /metrics. If time is left, the same run with the core in the server's
# process (LINRNN_ENABLE_MULTIPROCESSING=0) for an A/B on the same host.
# Results under $OUT: serve_core_process.json (+ serve_in_process.json), server logs.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

serve_and_bench() {  # $1: label, $2: port; env decides where the core runs
  python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port "$2" \
    --max-num-seqs 64 --disable-log-requests > "$OUT/server_$1.log" 2>&1 &
  local srv=$!
  for i in $(seq 1 150); do curl -sf "127.0.0.1:$2/health" >/dev/null && break; sleep 1; done
  el "$1: server up (pid $srv; child processes: $(cat /proc/$srv/task/$srv/children 2>/dev/null | wc -w))"
  ps -o pid,ppid,rss,args --ppid "$srv" | cut -c1-120
  timeout 100 python3 -m linrnn_serve bench serve --base-url "http://127.0.0.1:$2" --input-len 128 --output-len 128 \
    --max-concurrency 1,64 --out "$OUT/serve_$1.json" 2>&1 | awk '/^\| concurrency/{p=1} p'
  curl -s "127.0.0.1:$2/metrics" | grep -E "^linrnn:core_decode_(step_seconds_(sum|count)|steps_total)" | head -4
  kill -INT $srv; wait $srv
  el "$1: done"
}

serve_and_bench core_process 8014
if [ $(( $(date +%s) - T0 )) -lt 140 ]; then
  LINRNN_ENABLE_MULTIPROCESSING=0 serve_and_bench in_process 8015
else
  echo "skipping the in-process A/B run (not enough time left)"
fi
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print("| core | concurrency | TTFT median ms | TPOT median ms | output tok/s | failed |\n|---|---:|---:|---:|---:|---:|")
for label in ("core_process", "in_process"):
    p = os.path.join(out, f"serve_{label}.json")
    if os.path.exists(p):
        for r in json.load(open(p))["runs"]:
            print(f"| {label} | {r['max_concurrency']} | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | "
                  f"{r['output_throughput']:.0f} | {r['failed']} |")
PY
