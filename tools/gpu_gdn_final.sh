#!/usr/bin/env bash
# GDN decode retune, one device call: GDN kernel + hybrid-state tests and the engine's GPU tests (graphs
# vs eager bit-exact), the gdn-decode registry entry (test, then benchmark with the fla peer), then
# the decode config sweep. Logs and tables under $OUT.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
timeout 200 python3 -m pytest tests/test_gdn_kernels.py tests/test_hybrid_state.py -n 8 --dist loadfile -q \
  -p no:cacheprovider -rfE --timeout 150 2>&1 | tee "$OUT/gpu_gdn_tests.log" | tail -4
timeout 200 python3 -m pytest -m gpu tests/test_engine_gpu.py -q -p no:cacheprovider -rfE --timeout 180 2>&1 \
  | tee "$OUT/gpu_engine_tests.log" | tail -4
timeout 200 python3 -m linrnn_serve bench kernels --only gdn-decode --timeout-factor 2 --results-dir $OUT/k 2>&1 \
  | grep -vE "Warning|warner" | tail -30
timeout 150 python3 -m linrnn_bench.kernels.gdn --out $OUT/gdn --prefill "" --batches 1,8,32,64,128,256 --no-peer \
  --sweep 2>&1 | grep -E "Error|error|wrote"
