#!/usr/bin/env bash
# Issue #14 serving latency on one H200 (35B-A3B NVFP4 dummy, in 128 / out 128), as gpu_final.sh part B
# starts the server. Pass the commit: LINRNN_COMMIT=<sha>. Results under $OUT.
#   bash tools/gpu_serve_probe.sh probe   # ~3.5 min: the traced server (benchmarks/serve_probe.py) at
#       # concurrency 1: per-hop latency / ITL table (core send -> server receive -> event-loop wake -> SSE
#       # write -> client), per-thread CPU / context switches; `bench serve` c = 1 on the same server.
#       # Variants: default (core process, uvicorn's auto loop), asyncio loop, core in process.
#   bash tools/gpu_serve_probe.sh bench   # ~3.5 min: the no-blocking-sync GPU tests (admission / prefill /
#       # penalised steps, steady decode; tiny model), one traced probe, `bench serve` c = 1 and 64 on the
#       # default server, then `bench batched` npl 1 / 64 (ratios: TPOT vs ms/step, c = 64 tok/s vs S_TG)
#   bash tools/gpu_serve_probe.sh mnbt    # ~3.5 min: `bench serve` c = 1 and 64 at --max-num-batched-tokens
#       # 8192 / 4096 / 1024 (the default is 2048)
[ -n "$PROBE_LOCAL" ] || . tools/device_env.sh >/dev/null  # PROBE_LOCAL=1: a CPU dry run (SERVE=...)
OUT=${OUT:-/tmp/out}; R=/tmp/sprobe; mkdir -p $R $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
{ echo "nproc $(nproc); cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null); kernel $(uname -r)"
  python3 -c "import sys, uvicorn; print('python', sys.version.split()[0], '| uvicorn', uvicorn.__version__)"
  python3 -c "import uvloop; print('uvloop', uvloop.__version__)" 2>&1 | tail -1
  python3 -c "import httptools; print('httptools', httptools.__version__)" 2>&1 | tail -1
  python3 -c "import zmq; print('pyzmq', zmq.__version__, 'libzmq', zmq.zmq_version())"
  echo "cpu pressure: $(head -1 /proc/pressure/cpu 2>/dev/null)"; } | tee $R/sysinfo.txt
SERVE=${SERVE:-"--model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --max-num-seqs 64 --disable-log-requests"}

start_server() {  # label port [probe-server args...]: sets S (server pid); traced when the label is probed
  local label=$1 port=$2; shift 2
  python3 -m linrnn_bench.serve_probe server --trace-dir $R/trace_$label "$@" -- $SERVE --port $port \
    > $R/server_$label.log 2>&1 &
  S=$!
  for i in $(seq 1 150); do curl -sf 127.0.0.1:$port/health >/dev/null && return 0; sleep 1; done
  echo "server $label did not come up"; tail -5 $R/server_$label.log; return 1
}

stop_server() { kill -INT $S 2>/dev/null; sleep 3; kill -9 $S 2>/dev/null; wait $S 2>/dev/null; }

probe() {  # label port
  local label=$1 port=$2 core
  core=$(pgrep -P $S | head -1)
  timeout 60 python3 -m linrnn_bench.serve_probe client --base-url http://127.0.0.1:$port --trace-dir $R/trace_$label \
    --requests 6 --pids $S${core:+,$core} --out $R/probe_$label.json > $R/probe_$label.md 2>&1
  echo "## $label"; cat $R/probe_$label.md
}

serve() {  # label port concurrencies
  timeout 100 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$2 --input-len 128 --output-len 128 \
    --max-concurrency $3 --out $R/serve_$1.json > $R/serve_$1.log 2>&1
  python3 - $R/serve_$1.json $1 <<'PY'
import json, sys
print("| server | concurrency | TTFT median ms | TPOT median ms | ITL median ms | out tok/s | failed |")
print("|---|---:|---:|---:|---:|---:|---:|")
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"| {sys.argv[2]} | {r['max_concurrency']} | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | "
          f"{r['itl_ms']['median']:.2f} | {r['output_throughput']:.0f} | {r['failed']} |")
PY
}

case "${1:-probe}" in
  probe)
    start_server default 8041 && { probe default 8041; serve default 8041 1; }; stop_server; el "default done"
    start_server asyncio 8042 --loop asyncio && { probe asyncio 8042; serve asyncio 8042 1; }; stop_server
    el "asyncio loop done"
    LINRNN_ENABLE_MULTIPROCESSING=0 start_server inproc 8043 && { probe inproc 8043; serve inproc 8043 1; }
    stop_server; el "in-process done" ;;
  bench)
    timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_overlap_gpu.py \
      -k "admission or (steady and tiny)" > $R/tests_gpu.log 2>&1; tail -3 $R/tests_gpu.log; el "gpu tests done"
    start_server default 8044 && { probe default 8044; serve default 8044 1,64; }; stop_server; el "serve done"
    timeout 120 python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg 128 \
      --npl 1,64 --no-progress --out $R/batched > $R/batched.log 2>&1
    el "batched done"; grep -E "^\| (PP|128)" $R/batched/batched.md | head -8 ;;
  mnbt)  # c = 64 (and c = 1) throughput against --max-num-batched-tokens (default 2048)
    for m in 8192 4096 1024; do
      SERVE="$SERVE --max-num-batched-tokens $m" start_server mnbt$m 8045 && serve mnbt$m 8045 1,64; stop_server
      el "max-num-batched-tokens $m done"
    done ;;
esac
rm -rf $R/trace_*/core-*.jsonl.tmp
tar czf $OUT/serve_probe.tgz -C /tmp sprobe
