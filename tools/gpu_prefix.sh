#!/usr/bin/env bash
# Prefix caching on the GPU (issue #16). Run from the repo root on the device machine:
#   bash tools/gpu_prefix.sh test   # lossless restore, 35B-A3B-shaped dummy bf16 (4 layers), CUDA graphs,
#                                   # tau inf and 16, p in {1,15,16,17,63,64,65,1000}: "2 passed" expected
#   bash tools/gpu_prefix.sh on     # benefit run, prefix caching on  (35B NVFP4 dummy, ~3-5 min)
#   bash tools/gpu_prefix.sh off    # the same run, caching off
#   bash tools/gpu_prefix.sh report # per-turn tables + TTFT p50 (turns 2-8) ratio off/on, output tok/s
#   bash tools/gpu_prefix.sh on LABEL [server flags]   # a variant (results *_LABEL.*); TRACE=1: the traced
#                                   # server and tools/prefix_timeline.py's TTFT breakdown and step list
#   bash tools/gpu_prefix.sh report ON_LABEL OFF_LABEL
#   bash tools/gpu_prefix.sh all    # the four in one call (may exceed one 10-minute device call)
# The benefit run: bench serve --workload multi-turn, 32 users x 8 turns, a 2048-token system prompt
# shared by all users, 128 new user tokens + 128 output tokens per turn (replies re-sent as ids).
# Acceptance: TTFT p50 over turns 2-8 with caching <= 1/5 of without; output tok/s not lower.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PORT=${PORT:-8013}

run_test() {
  timeout 500 python3 -m pytest -m gpu tests/test_prefix_gpu.py -x -q -p no:cacheprovider 2>&1 | tail -8 \
    | tee "$OUT/prefix_gpu_test.txt"
}

run_bench() {  # $1 = on | off, $2 = label (default $1), then extra server flags; TRACE=1: the traced server
  local flag=--enable-prefix-caching label=${2:-$1}
  [ "$1" = off ] && flag=--no-enable-prefix-caching
  shift; [ $# -gt 0 ] && shift
  local serve=(python3 -m linrnn_serve)
  [ -n "$TRACE" ] && { rm -rf /tmp/ptrace_$label; serve=(python3 -m linrnn_bench.serve_probe server --trace-dir /tmp/ptrace_$label --); }
  timeout 300 "${serve[@]}" --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port $PORT \
    --max-num-seqs 64 $flag "$@" > "$OUT/prefix_server_$label.log" 2>&1 &
  local srv=$!
  for _ in $(seq 1 240); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  timeout 150 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$PORT --workload multi-turn \
    --num-users 32 --num-turns 8 --system-len 2048 --user-len 128 --output-len 128 \
    --out "$OUT/prefix_multi_turn_$label.json" 2>&1 | grep -v "HTTP Request" | tee "$OUT/prefix_multi_turn_$label.txt"
  curl -s 127.0.0.1:$PORT/metrics | grep -E "prefix_cache|num_preemptions_total|kv_cache_usage" \
    > "$OUT/prefix_metrics_$label.txt"
  [ -n "$TRACE" ] && curl -s 127.0.0.1:$PORT/probe/trace > /tmp/ptrace_$label/server.json
  kill -INT $srv; wait $srv
  if [ -n "$TRACE" ]; then
    python3 tools/prefix_timeline.py "$OUT/prefix_multi_turn_$label.json" /tmp/ptrace_$label \
      /tmp/ptrace_$label/server.json | tee "$OUT/prefix_timeline_$label.md"
    tar czf "$OUT/prefix_trace_$label.tgz" -C /tmp ptrace_$label
  fi
}

report() {  # [on label] [off label]
  python3 - "$OUT" "${1:-on}" "${2:-off}" <<'PY'
import json, sys
out = sys.argv[1]
r = {m: json.load(open(f"{out}/prefix_multi_turn_{l}.json"))["runs"][0] for m, l in (("on", sys.argv[2]), ("off", sys.argv[3]))}
print(f"on = {sys.argv[2]}, off = {sys.argv[3]}")
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
  on|off) run_bench "$@" ;;
  report) shift; report "$@" | tee -a "$OUT/prefix_report.md" ;;
  all) run_test; run_bench on; run_bench off; report | tee "$OUT/prefix_report.md" ;;
esac
