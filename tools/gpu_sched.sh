#!/usr/bin/env bash
# Time to first token on the prefix-caching benefit workload (issue #16) and serving at c = 64 (issue #14), one
# H200 call (~4 min). Pass LINRNN_COMMIT=<sha>.
#   1. gpu_prefix.sh on (traced server: tools/prefix_timeline.py's TTFT breakdown per turn and one turn's
#      steps) + off + report
#   2. bench serve in 128 / out 128 at concurrency 64
# Everything lands in $OUT/sched.tgz plus $OUT/sched_report.md (two files: the device returns few).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=/tmp/sched; rm -rf $W; mkdir -p $W $OUT
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
python3 -c "import httptools, uvloop; print(f'uvicorn on uvloop {uvloop.__version__}, httptools {httptools.__version__}')" \
  2>&1 | tail -1 | tee -a $W/report.md  # the server's event loop and HTTP parser (.whl/ carries both)
OUT=$W TRACE=1 timeout 170 bash tools/gpu_prefix.sh on on
OUT=$W timeout 170 bash tools/gpu_prefix.sh off off
OUT=$W bash tools/gpu_prefix.sh report on off >> $W/report.md
cat $W/prefix_timeline_on.md >> $W/report.md
timeout 150 python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port 8051 \
  --max-num-seqs 64 --disable-log-requests > $W/serve64_server.log 2>&1 &
srv=$!
for _ in $(seq 1 120); do curl -sf 127.0.0.1:8051/health >/dev/null && break; sleep 1; done
timeout 60 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:8051 --input-len 128 --output-len 128 \
  --max-concurrency 64 --out $W/serve64.json > $W/serve64.log 2>&1
kill -INT $srv; wait $srv
python3 - $W/serve64.json <<'PY' | tee -a $W/report.md
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
print("\n| c = 64 | TTFT median ms | TPOT median ms | ITL median ms | ITL p99 ms | out tok/s | duration s | failed |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
print(f"| serve | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | {r['itl_ms']['median']:.2f} | "
      f"{r['itl_ms']['p99']:.1f} | {r['output_throughput']:.0f} | {r['duration_s']:.2f} | {r['failed']} |")
PY
cp $W/report.md $OUT/sched_report.md
tar czf $OUT/sched.tgz -C /tmp sched
cat $OUT/sched_report.md
