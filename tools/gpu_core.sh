#!/usr/bin/env bash
# Engine-core session (#14) on one GPU: (1) `bench batched` with the host-gap column (timed ms/step minus
# profiled kernel ms/step) at B = 1 and 128; (2) the GPU engine tests; (3) `bench serve` through the
# server whose engine core runs in its own process (TTFT / TPOT at concurrency 1, output tok/s at 64).
# Needs in .whl/: pyzmq, msgspec (present) and prometheus_client (pure Python:
# prometheus_client-0.26.0-py3-none-any.whl).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 300 python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg 128 \
  --npl 1,64,128 --profile 1,128 --profile-steps 20 --out "$OUT/batched_host_gap" 2>&1 | grep -E "^\||profile:"
timeout 240 python3 -m pytest -q -m gpu tests/test_engine_gpu.py 2>&1 | tail -5
python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port 8014 --max-num-seqs 64 \
  > "$OUT/server.log" 2>&1 &
SRV=$!
for i in $(seq 1 180); do curl -sf 127.0.0.1:8014/health >/dev/null && break; sleep 1; done
timeout 200 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:8014 --input-len 128 --output-len 128 \
  --max-concurrency 1,64 --out "$OUT/serve_core_process.json" 2>&1 | grep "^|"
curl -s 127.0.0.1:8014/metrics | grep -E "^(linrnn|vllm):(core_decode|num_steps|time_to_first)" | head -12
kill -INT $SRV; wait $SRV
