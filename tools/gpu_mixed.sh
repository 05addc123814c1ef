#!/usr/bin/env bash
# Mixed batches (--mixed-batch: decode rows ride in the prefill forward; issue #14 c = 64 line, #16 TTFT), one
# H200 call; pass LINRNN_COMMIT=<sha>. 35B-A3B NVFP4 dummy, --max-num-seqs 64. Run with timeout_s 600 (or 360
# without stage 4: BUDGET=0); every stage has its own timeout, so a hang still leaves the table.
#   0. MIXED_TEST=1: `pytest -m gpu tests/test_mixed_batch.py` first (tiny f32, graphs: mixed == separate; ~2 min)
#   1. bench batched --npl 64 (PP = TG = 128): S_TG. It runs first: the first engine of a fresh machine pays the
#      Triton JIT (a server then took 102 s to start instead of 28 s: budget for it)
#   2. bench serve in 128 / out 128 at concurrency 64 (two runs) with --mixed-batch, 3. with --no-mixed-batch;
#      ratio = serve output tok/s / S_TG (target >= 0.9)
#   4. if BUDGET (default 560) - elapsed >= 80 s: the #16 multi-turn workload (32 users x 8 turns, 2048-token system
#      prompt, 128 + 128 tokens per turn), prefix caching on, --mixed-batch (final_run_5 with separate forwards:
#      turns 2-8 TTFT p50 127.8 ms, output 3018 tok/s)
# Prints a table; $OUT/mixed_report.md + $OUT/mixed.tgz (logs, JSON).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=/tmp/mixed; rm -rf $W; mkdir -p $W $OUT
PORT=8061
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md

serve() {  # $1 label, $2 server timeout, then server flags; the c = 64 bench (or $WORKLOAD) against it
  local label=$1 t=$2; shift 2
  timeout $t python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port $PORT \
    --max-num-seqs 64 --disable-log-requests "$@" > $W/server_$label.log 2>&1 &
  local srv=$!
  for _ in $(seq 1 $t); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  echo "[$SECONDS s] $label: server up" | tee -a $W/report.md
  if [ "$label" = multi_turn ]; then
    timeout $((t - 10)) python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$PORT --workload multi-turn \
      --num-users 32 --num-turns 8 --system-len 2048 --user-len 128 --output-len 128 --out $W/$label.json \
      > $W/$label.log 2>&1
  else
    timeout 50 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$PORT --input-len 128 \
      --output-len 128 --max-concurrency 64,64 --out $W/$label.json > $W/$label.log 2>&1
  fi
  grep -E "mixed batches|engine ready" $W/server_$label.log | tail -1 | sed 's/.*INFO//' >> $W/report.md
  kill -INT $srv; wait $srv
  echo "[$SECONDS s] $label: done" | tee -a $W/report.md
}

if [ -n "$MIXED_TEST" ]; then
  timeout 240 python3 -m pytest -m gpu tests/test_mixed_batch.py -x -q -p no:cacheprovider 2>&1 | tail -5 \
    | tee $W/gpu_test.txt | tee -a $W/report.md
fi
timeout 170 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 64 \
  --config "model=qwen35moe-nvfp4" --no-progress --out $W/batched > $W/batched.log 2>&1
echo "[$SECONDS s] batched: done" | tee -a $W/report.md
serve mixed_on 140 --mixed-batch
serve mixed_off 120 --no-mixed-batch
left=$((${BUDGET:-560} - SECONDS))
[ $left -ge 80 ] && serve multi_turn $((left < 200 ? left : 200)) --mixed-batch --enable-prefix-caching

python3 - $W <<'PY' | tee -a $W/report.md
import json, os, sys
w = sys.argv[1]
def load(name):
    try:
        return json.load(open(f"{w}/{name}"))
    except Exception as e:
        print(f"({name}: {type(e).__name__} {e})")
        return None
b = load("batched/batched.json")
s_tg = None
if b:
    rows = [r for r in b["configs"][0]["rows"] if r["B"] == 64]
    s_tg = rows[0]["S_TG"] if rows else None
print(f"\nbench batched npl 64 (PP = TG = 128): S_TG {s_tg:.0f} tok/s, ms/step {rows[0]['ms_per_step']:.2f}" if s_tg
      else "\nbench batched: no result")
print("\n| c = 64 | run | TTFT median ms | TPOT median ms | ITL median ms | ITL p99 ms | out tok/s | / S_TG | duration s | failed |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for label in ("mixed_on", "mixed_off"):
    d = load(f"{label}.json")
    for i, r in enumerate(d["runs"] if d else []):
        ratio = f"{r['output_throughput'] / s_tg:.3f}" if s_tg else "-"
        print(f"| {label} | {i + 1} | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | "
              f"{r['itl_ms']['median']:.2f} | {r['itl_ms']['p99']:.1f} | {r['output_throughput']:.0f} | {ratio} | "
              f"{r['duration_s']:.2f} | {r['failed']} |")
m = load("multi_turn.json") if os.path.exists(f"{w}/multi_turn.json") else None
if m:
    r = m["runs"][0]
    print("\nmulti-turn, prefix caching on, --mixed-batch:\n\n| turn | TTFT p50 ms | hit rate |\n|---:|---:|---:|")
    for t in r["turns"]:
        print(f"| {t['turn']} | {t['ttft_ms']['median']:.1f} | {100 * t['hit_rate']:.1f} % |")
    print(f"turns 2-8 TTFT p50 {r['ttft_ms_turns_2_plus']['median']:.1f} ms (final_run_5, separate forwards: 127.8 ms); "
          f"output tok/s {r['output_throughput']:.0f} (final_run_5: 3018); failed {r['failed']}")
else:
    print("\nmulti-turn: not run (no time left) or no result")
PY
cp $W/report.md $OUT/mixed_report.md
tar czf $OUT/mixed.tgz -C /tmp mixed
cat $OUT/mixed_report.md
