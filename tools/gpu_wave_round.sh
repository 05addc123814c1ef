#!/usr/bin/env bash
# Wave round (issue #14 c = 64 line): one H200 call; pass LINRNN_COMMIT=<sha>; timeout_s 240.
#   A. bench batched --npl 1,64 (PP = TG = 128, token budget 8192): ms/step at npl 1, S_TG at npl 64 (SKIP_BATCHED=1:
#      not run; the ratios then use final_run_7's numbers, said so in the report)
#   B. per '|'-separated flag set of SERVE_FLAGS (default "|--mixed-batch"; labels 0, 1, ...): one server
#      (--max-num-seqs 64), bench serve in 128 / out 128 at concurrency 1, 64, 64; a flag set starts only if
#      the call has >= 95 s left of BUDGET (default 232 s): a server takes ~65 s to start; CONC_REST=64: the flag sets
#      after the first run c = 64 once only and start with >= NEED_REST (default 70) s left
#   B2. CONTROL="ENV=VALUE ..." (e.g. LINRNN_PREFILL_GRAPH_MAX_TOKENS=4096): bench batched --npl 64 --ntg 8 again
#      under that environment, if >= ${CONTROL_MIN:-55} s are left: T_PP of the same 8192-token step, A/B in one call
#   C. the report: the acceptance lines (c = 64 output tok/s >= 0.9 x S_TG; c = 1 TTFT median <= 25 ms; c = 1 TPOT
#      median within 10 % of npl 1's ms/step) and the per-wave arithmetic of each c = 64 run: wave = duration /
#      (prompts / 64); decode = 127 x npl 64's ms/step; the rest (prefill + hand-back) against what 0.9 x S_TG
#      allows; with each server's burst-coalescing and late-binding log lines
# Every stage has its own timeout; $OUT/report.md, JSON and logs beside it.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=$OUT; mkdir -p $W
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
BUDGET=${BUDGET:-232}
if [ -z "${SKIP_BATCHED-}" ] && [ -z "${BATCHED_DONE-}" ]; then  # BATCHED_DONE: $OUT/batched/ exists (its first config f32)
  timeout ${TA:-100} python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,64 \
    --config "model=qwen35moe-nvfp4" --no-progress --out $W/batched --max-num-batched-tokens 8192 > $W/batched.log 2>&1
  echo "[$SECONDS s] batched: rc $?" | tee -a $W/report.md
fi
serve_one() {  # $1 label, $2 port, then extra server flags
  local label=$1 port=$2; shift 2
  timeout $((BUDGET - SECONDS - 3)) python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy \
    --host 127.0.0.1 --port $port --max-num-seqs 64 --disable-log-requests "$@" > $W/server$label.log 2>&1 &
  local srv=$!
  for _ in $(seq 1 110); do curl -sf 127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  echo "[$SECONDS s] server$label up (flags: $*)" | tee -a $W/report.md
  timeout $((BUDGET - SECONDS - 6)) python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$port \
    --input-len 128 --output-len 128 --max-concurrency $CONC --out $W/serve$label.json > $W/serve$label.log 2>&1
  echo "[$SECONDS s] serve$label: rc $?" | tee -a $W/report.md
  kill -INT $srv; wait $srv
  grep -E "captured .* CUDA graphs|warm-up:" $W/server$label.log | sed 's/.*\]: //' | tee -a $W/report.md
  grep -E "burst coalescing|late binding:" $W/server$label.log | sed 's/.*\[core\]: //' | tee -a $W/report.md
}
IFS='|' read -ra FLAG_SETS <<< "${SERVE_FLAGS-|--mixed-batch}"
[ ${#FLAG_SETS[@]} -eq 0 ] && FLAG_SETS=("")
LABELS=()
for i in "${!FLAG_SETS[@]}"; do
  CONC=1,64,64; NEED=95
  [ $i -gt 0 ] && [ -n "${CONC_REST-}" ] && CONC=$CONC_REST && NEED=${NEED_REST:-70}  # e.g. a control at c = 64 only
  if [ $((BUDGET - SECONDS)) -lt $NEED ]; then
    echo "[$SECONDS s] server_$i (flags: ${FLAG_SETS[$i]}) not started: $((BUDGET - SECONDS)) s left" | tee -a $W/report.md
    continue
  fi
  LABELS+=("_$i:${FLAG_SETS[$i]}")
  serve_one "_$i" $((8071 + i)) ${FLAG_SETS[$i]}
done
if [ -n "${CONTROL-}" ]; then
  if [ $((BUDGET - SECONDS)) -ge ${CONTROL_MIN:-55} ]; then
    env $CONTROL timeout $((BUDGET - SECONDS - 4)) python3 -m linrnn_serve bench batched --load-format dummy --npp 128 \
      --ntg 8 --npl 64 --config "model=qwen35moe-nvfp4" --no-progress --out $W/batched_control \
      --max-num-batched-tokens 8192 > $W/batched_control.log 2>&1
    echo "[$SECONDS s] batched control ($CONTROL): rc $?" | tee -a $W/report.md
  else
    echo "[$SECONDS s] batched control ($CONTROL) not started: $((BUDGET - SECONDS)) s left" | tee -a $W/report.md
  fi
fi
python3 - $W "${LABELS[@]}" <<'PY' | tee -a $W/report.md
import json, sys
w = sys.argv[1]
def load(p):
    try:
        return json.load(open(f"{w}/{p}"))
    except Exception as e:
        print(f"({p}: {type(e).__name__} {e})")
import os
b = None if os.environ.get("SKIP_BATCHED") else load("batched/batched.json")
rows = {r["B"]: r for r in b["configs"][0]["rows"]} if b else {}
if not b:  # SKIP_BATCHED: final_run_7's bench batched (6bac491, H200), not this call's
    print("\n(no bench batched in this call: the ratios use final_run_7's npl 1 2.183 ms/step, npl 64 S_TG 6,306)")
    rows = {1: {"ms_per_step": 2.183}, 64: {"ms_per_step": 10.15, "S_TG": 6306.0, "T_PP": 0.138}}
r1, r64 = rows.get(1), rows.get(64)
if r1 and r64:
    print(f"\nbench batched: npl 1 {r1['ms_per_step']:.3f} ms/step; npl 64 S_TG {r64['S_TG']:.0f} tok/s "
          f"({r64['ms_per_step']:.3f} ms/step), T_PP {r64['T_PP']:.3f} s")
c = load("batched_control/batched.json") if os.environ.get("CONTROL") else None
rc = {r["B"]: r for r in c["configs"][0]["rows"]}.get(64) if c and c.get("configs") else None
if rc and r64:
    print(f"T_PP of the 64 x 128 step: {1e3 * r64['T_PP']:.1f} ms (this commit) vs {1e3 * rc['T_PP']:.1f} ms "
          f"({os.environ['CONTROL']})")
print("\n| server flags | c | TTFT median ms | TPOT median ms | ITL p99 ms | out tok/s | acceptance | per wave: wave ms = "
      "127 decode steps + the rest (0.9x allows) |")
print("|---|---:|---:|---:|---:|---:|---|---|")
for lf in sys.argv[2:]:
    label, flags = lf.split(":", 1)
    for r in (load(f"serve{label}.json") or {}).get("runs", []):
        c = r.get("max_concurrency")
        acc = wave = "-"
        if c == 1 and r1:
            tp = r["tpot_ms"]["median"] / r1["ms_per_step"] - 1
            acc = (f"TTFT {'<=' if r['ttft_ms']['median'] <= 25 else '>'} 25 ms; TPOT {100 * tp:+.1f} % vs npl 1 "
                   f"({'met' if abs(tp) <= 0.10 else 'missed'})")
        elif c == 64 and r64:
            q = r["output_throughput"] / r64["S_TG"]
            acc = f"{q:.3f} x S_TG ({'met' if q >= 0.9 else 'missed'})"
            waves = r["num_prompts"] / c
            wave_ms = 1e3 * r["duration_s"] / waves
            dec = 127 * r64["ms_per_step"]
            allow = 1e3 * c * r["output_len"] / (0.9 * r64["S_TG"]) - dec
            wave = f"{wave_ms:.1f} = {dec:.1f} + {wave_ms - dec:.1f} ({allow:.1f})"
        print(f"| {flags or 'default'} | {c} | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | "
              f"{r['itl_ms']['p99']:.1f} | {r['output_throughput']:.0f} | {acc} | {wave} |")
PY
cat $W/report.md
