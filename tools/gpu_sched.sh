#!/usr/bin/env bash
# Scheduling for time to first token (issues #16 / #14), one H200 call (~5 min). Pass LINRNN_COMMIT=<sha>.
#   1. the #16 benefit run with the default policy: gpu_prefix.sh on (traced: tools/prefix_timeline.py's
#      TTFT breakdown per turn and one turn's steps) + off + report
#   2. bench serve in 128 / out 128 at concurrency 64, default vs prefill first + synchronous prefill steps
#      (--max-decode-pause-steps 4 --no-async-scheduling-prefill)
#   SYNC=1 bash tools/gpu_sched.sh: instead, synchronous prefill steps alone (--no-async-scheduling-prefill)
#      against the default: on (traced) both ways, off with it (~5 min), then c = 64 with it
# Everything lands in $OUT/sched.tgz plus $OUT/sched_report.md (two files: the device returns few).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=/tmp/sched; rm -rf $W; mkdir -p $W $OUT
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
if [ -n "$SYNC" ]; then
  OUT=$W TRACE=1 timeout 150 bash tools/gpu_prefix.sh on on_sync --no-async-scheduling-prefill
  OUT=$W timeout 150 bash tools/gpu_prefix.sh off off_sync --no-async-scheduling-prefill
  OUT=$W TRACE=1 timeout 150 bash tools/gpu_prefix.sh on on
  OUT=$W bash tools/gpu_prefix.sh report on_sync off_sync >> $W/report.md
  { echo; echo "default on vs off_sync:"; OUT=$W bash tools/gpu_prefix.sh report on off_sync | tail -2; } >> $W/report.md
  cat $W/prefix_timeline_on_sync.md $W/prefix_timeline_on.md >> $W/report.md
else
  OUT=$W TRACE=1 timeout 170 bash tools/gpu_prefix.sh on on
  OUT=$W timeout 170 bash tools/gpu_prefix.sh off off
  OUT=$W bash tools/gpu_prefix.sh report on off >> $W/report.md
  cat $W/prefix_timeline_on.md >> $W/report.md
fi
serve64() {  # label [server flags]
  local label=$1; shift
  timeout 150 python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port 8051 \
    --max-num-seqs 64 --disable-log-requests "$@" > $W/serve64_server_$label.log 2>&1 &
  local srv=$!
  for _ in $(seq 1 120); do curl -sf 127.0.0.1:8051/health >/dev/null && break; sleep 1; done
  timeout 60 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:8051 --input-len 128 --output-len 128 \
    --max-concurrency 64 --out $W/serve64_$label.json > $W/serve64_$label.log 2>&1
  kill -INT $srv; wait $srv
  python3 - $W/serve64_$label.json $label <<'PY' | tee -a $W/report.md
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
print(f"| {sys.argv[2]} | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | {r['itl_ms']['median']:.2f} | "
      f"{r['itl_ms']['p99']:.1f} | {r['output_throughput']:.0f} | {r['duration_s']:.2f} | {r['failed']} |")
PY
}
printf '\n| c = 64 server | TTFT median ms | TPOT median ms | ITL median ms | ITL p99 ms | out tok/s | duration s | failed |\n|---|---:|---:|---:|---:|---:|---:|---:|\n' >> $W/report.md
if [ -n "$SYNC" ]; then
  serve64 sync_prefill --no-async-scheduling-prefill
else
  serve64 default
  serve64 prefill_first --max-decode-pause-steps 4 --no-async-scheduling-prefill
fi
cp $W/report.md $OUT/sched_report.md
tar czf $OUT/sched.tgz -C /tmp sched
cat $OUT/sched_report.md
