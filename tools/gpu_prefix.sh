#!/usr/bin/env bash
# Prefix caching on the GPU (issue #16). Run from the repo root on the device machine:
#   bash tools/gpu_prefix.sh test   # lossless restore, 35B-A3B-shaped dummy bf16 (4 layers), CUDA graphs,
#                                   # tau inf and 16, p in {1,15,16,17,63,64,65,1000}: "2 passed" expected
#   bash tools/gpu_prefix.sh on     # benefit run, prefix caching on  (35B NVFP4 dummy, ~3-5 min)
#   bash tools/gpu_prefix.sh off    # the same run, caching off
#   bash tools/gpu_prefix.sh report # per-turn tables + TTFT p50 (turns 2-8) ratio off/on, output tok/s
#   bash tools/gpu_prefix.sh all    # the four in one call (may exceed one 10-minute device call)
# The benefit run: bench serve --workload multi-turn, 32 users x 8 turns, a 2048-token system prompt
# shared by all users, 128 new user tokens + 128 output tokens per turn (replies re-sent as ids).
# Acceptance: TTFT p50 over turns 2-8 with caching <= 1/5 of without; output tok/s not lower.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PORT=8013

run_test() {
  timeout 500 python3 -m pytest -m gpu tests/test_prefix_gpu.py -x -q -p no:cacheprovider 2>&1 | tail -8 \
    | tee "$OUT/prefix_gpu_test.txt"
}

run_bench() {  # $1 = on | off
  local flag=--enable-prefix-caching
  [ "$1" = off ] && flag=--no-enable-prefix-caching
  python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port $PORT \
    --max-num-seqs 64 $flag > "$OUT/prefix_server_$1.log" 2>&1 &
  local srv=$!
  for _ in $(seq 1 300); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  timeout 420 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$PORT --workload multi-turn \
    --num-users 32 --num-turns 8 --system-len 2048 --user-len 128 --output-len 128 \
    --out "$OUT/prefix_multi_turn_$1.json" 2>&1 | tee "$OUT/prefix_multi_turn_$1.txt"
  curl -s 127.0.0.1:$PORT/metrics | grep -E "prefix_cache|num_preemptions_total|kv_cache_usage" \
    > "$OUT/prefix_metrics_$1.txt"
  kill -INT $srv; wait $srv
}

report() {
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
r = {m: json.load(open(f"{out}/prefix_multi_turn_{m}.json"))["runs"][0] for m in ("on", "off")}
print("| turn | TTFT p50 on ms | TTFT p50 off ms | hit rate on |")
print("|---:|---:|---:|---:|")
for a, b in zip(r["on"]["turns"], r["off"]["turns"]):
    print(f"| {a['turn']} | {a['ttft_ms']['median']:.1f} | {b['ttft_ms']['median']:.1f} | {100 * a['hit_rate']:.1f} % |")
on, off = r["on"]["ttft_ms_turns_2_plus"]["median"], r["off"]["ttft_ms_turns_2_plus"]["median"]
print(f"turns 2-8 TTFT p50: on {on:.1f} ms, off {off:.1f} ms, ratio off/on {off / on:.2f}x (target >= 5x: "
      f"{'met' if off >= 5 * on else 'MISSED'})")
to, tf = r["on"]["output_throughput"], r["off"]["output_throughput"]
print(f"output tok/s: on {to:.1f}, off {tf:.1f} ({'not lower' if to >= tf else 'LOWER'}); hit rate on "
      f"{100 * r['on']['hit_rate']:.1f} %, failed on/off {r['on']['failed']}/{r['off']['failed']}; replies as ids "
      f"{r['on']['replies_as_ids']}")
PY
}

case "${1:-all}" in
  test) run_test ;;
  on|off) run_bench "$1" ;;
  report) report | tee "$OUT/prefix_report.md" ;;
  all) run_test; run_bench on; run_bench off; report | tee "$OUT/prefix_report.md" ;;
esac
