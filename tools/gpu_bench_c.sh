#!/usr/bin/env bash
# Device call: router launch-shape probe, NVFP4 MoE config sweep, GDN prefill registry entry, and the
# serving benchmark against our server on Qwen3.5-35B-A3B shapes (NVFP4 dummy). Results under $OUT.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
echo "== router probe"; timeout 60 python3 -m linrnn_bench.kernels.route_probe 2>&1 | tee $OUT/route_probe.txt
echo "== moe sweep"; timeout 150 python3 -m linrnn_bench.kernels.moe --batch-sizes 64,256 --variants nvfp4/asm,bf16/ours \
  --sweep --sets 2 --rep 60 --out /tmp/moe_sweep 2>&1 | grep -vE "^\{" | tail -25
echo "== gdn prefill (registry)"; timeout 200 python3 -m linrnn_serve bench kernels --only gdn-prefill --timeout-factor 1.2 \
  --results-dir /tmp/k 2>&1 | tail -25
echo "== serving benchmark (35B-A3B shapes, NVFP4 dummy)"
python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port 8011 --max-num-seqs 64 \
  > /tmp/server.log 2>&1 &
SRV=$!
for i in $(seq 1 150); do curl -sf 127.0.0.1:8011/health >/dev/null && break; sleep 1; done
timeout 150 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:8011 --input-len 128 --output-len 128 \
  --max-concurrency 1,8,32,64 --out /tmp/serve_35b.json 2>&1 | tail -8
kill -INT $SRV; sleep 3; tail -5 /tmp/server.log
tar czf $OUT/bench_c.tgz -C /tmp moe_sweep k serve_35b.json server.log 2>/dev/null; ls -la $OUT
