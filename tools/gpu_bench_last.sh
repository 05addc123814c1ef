#!/usr/bin/env bash
# Last device call: the attention entry of the kernel registry, and the 35B serving benchmark again
# (the load generator now counts every choice chunk, as vLLM's does).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
timeout 260 python3 -m linrnn_serve bench kernels --only attention --timeout-factor 1.5 --results-dir /tmp/k 2>&1 \
  | grep -vE "Warning|warner" | tail -30
python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port 8011 --max-num-seqs 64 \
  > /tmp/server.log 2>&1 &
SRV=$!
for i in $(seq 1 150); do curl -sf 127.0.0.1:8011/health >/dev/null && break; sleep 1; done
timeout 150 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:8011 --input-len 128 --output-len 128 \
  --max-concurrency 1,8,32,64 --out /tmp/serve_35b.json 2>&1 | grep "^|"
kill -INT $SRV; sleep 3
tar czf $OUT/last.tgz -C /tmp k serve_35b.json server.log
