#!/usr/bin/env bash
# Prefill round (issue #14 c = 64 line), one H200 call each; pass LINRNN_COMMIT=<sha>; timeout_s 300.
# MODE=profile (the first call):
#   A. bench batched --npl 64,128 (PP = TG = 128) with --max-num-batched-tokens 8192: T_PP / S_PP / S_TG
#   B. tools/prefill_probe.py: one prefill forward of 2048 and 8192 tokens (16 / 64 x 128-token prompts):
#      wall, host, kernel ms per component against its floor, top kernels, graph replay
#   C. the same bench batched with --max-num-batched-tokens 2048
# MODE=serve (the second call, default engine flags, i.e. the default token budget):
#   A. bench batched --npl 1,64: ms/step at npl 1, S_TG at npl 64
#   B. one server (--max-num-seqs 64), bench serve in 128 / out 128 at concurrency 1, 64, 64: TTFT / TPOT medians,
#      output tok/s; the acceptance lines (c = 64 out tok/s >= 0.9 x S_TG; c = 1 TTFT median <= 25 ms; c = 1 TPOT
#      median within 10 % of the npl 1 ms/step) computed from A and B
#      SERVE_FLAGS="a|b" runs one server per '|'-separated flag set (e.g. "|--mixed-batch"), labels 0, 1, ...
#   C. if time is left (BUDGET, default 235 s, minus elapsed >= 50 s): the probe at 2048 / 8192 tokens again
# Every stage has its own timeout; $OUT/report.md, JSON and logs beside it.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=$OUT; mkdir -p $W
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
batched() {  # $1 label, $2 timeout, $3 npl, then extra flags
  local label=$1 t=$2 npl=$3; shift 3
  timeout $t python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl $npl \
    --config "model=qwen35moe-nvfp4" --no-progress --out $W/batched_$label "$@" > $W/batched_$label.log 2>&1
  echo "[$SECONDS s] batched $label: rc $?" | tee -a $W/report.md
  grep -A6 "| PP" $W/batched_$label/batched.md 2>/dev/null | head -6 | tee -a $W/report.md
}
probe() {
  timeout $1 python3 tools/prefill_probe.py --tokens 2048,8192 --prompt-len 128 --json $W/probe.json > $W/probe.log 2>&1
  echo "[$SECONDS s] probe: rc $?" | tee -a $W/report.md
  grep -v "^\[" $W/probe.log | grep -E "^\||^device|^\{" | cut -c1-200 >> $W/report.md
}
if [ "${MODE:-serve}" = profile ]; then
  batched 8192 ${TA:-110} 64,128 --max-num-batched-tokens 8192
  probe ${TB:-85}
  batched 2048 ${TC:-90} 64,128 --max-num-batched-tokens 2048
  cat $W/report.md; exit 0
fi
# the bench's own default budget is "all prompts in one step": pass the engine default explicitly
batched npl1_64 ${TA:-100} 1,64 --max-num-batched-tokens 8192
serve_one() {  # $1 label, $2 port, then extra server flags
  local label=$1 port=$2; shift 2
  timeout ${TS:-130} python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port $port \
    --max-num-seqs 64 --disable-log-requests "$@" > $W/server$label.log 2>&1 &
  local srv=$!
  for _ in $(seq 1 110); do curl -sf 127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  echo "[$SECONDS s] server$label up (flags: $*)" | tee -a $W/report.md
  grep -E "caches:|max_num_batched_tokens" $W/server$label.log | sed 's/.*INFO//' | cut -c1-400 | tee -a $W/report.md
  timeout 60 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$port --input-len 128 --output-len 128 \
    --max-concurrency 1,64,64 --out $W/serve$label.json > $W/serve$label.log 2>&1
  echo "[$SECONDS s] serve$label: rc $?" | tee -a $W/report.md
  kill -INT $srv; wait $srv
}
IFS='|' read -ra FLAG_SETS <<< "${SERVE_FLAGS-}"
[ ${#FLAG_SETS[@]} -eq 0 ] && FLAG_SETS=("")
LABELS=()
for i in "${!FLAG_SETS[@]}"; do
  label=$([ ${#FLAG_SETS[@]} -gt 1 ] && echo "_$i" || echo "")
  LABELS+=("$label:${FLAG_SETS[$i]}")
  serve_one "$label" $((8071 + i)) ${FLAG_SETS[$i]}
done
python3 - $W "${LABELS[@]}" <<'PY' | tee -a $W/report.md
import json, sys
w = sys.argv[1]
def load(p):
    try:
        return json.load(open(f"{w}/{p}"))
    except Exception as e:
        print(f"({p}: {type(e).__name__} {e})")
b = load("batched_npl1_64/batched.json")
rows = {r["B"]: r for r in b["configs"][0]["rows"]} if b else {}
r1, r64 = rows.get(1), rows.get(64)
if r1 and r64:
    print(f"\nbench batched: npl 1 {r1['ms_per_step']:.3f} ms/step; npl 64 S_TG {r64['S_TG']:.0f} tok/s "
          f"({r64['ms_per_step']:.2f} ms/step), T_PP {r64['T_PP']:.3f} s")
print("\n| server flags | c | TTFT median ms | TPOT median ms | ITL median ms | ITL p99 ms | out tok/s | acceptance |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
runs = []
for lf in sys.argv[2:]:
    label, flags = lf.split(":", 1)
    runs += [(flags or "default", r) for r in (load(f"serve{label}.json") or {}).get("runs", [])]
for flags, r in runs:
    c = r.get("max_concurrency")
    acc = "-"
    if c == 1 and r1:
        tp = r["tpot_ms"]["median"] / r1["ms_per_step"] - 1
        acc = (f"TTFT {'<=' if r['ttft_ms']['median'] <= 25 else '>'} 25 ms; TPOT {100 * tp:+.1f} % vs npl 1 "
               f"({'met' if abs(tp) <= 0.10 else 'missed'})")
    elif c == 64 and r64:
        q = r["output_throughput"] / r64["S_TG"]
        acc = f"{q:.3f} x S_TG ({'met' if q >= 0.9 else 'missed'})"
    print(f"| {flags} | {c} | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | {r['itl_ms']['median']:.2f} | "
          f"{r['itl_ms']['p99']:.1f} | {r['output_throughput']:.0f} | {acc} |")
PY
left=$((${BUDGET:-235} - SECONDS))
[ $left -ge 50 ] && probe $((left < 80 ? left : 80))
cat $W/report.md
