#!/usr/bin/env bash
# GDN decode, one device call: the full GPU test pass (tools/gpu_tests.sh), the gdn-decode registry entry
# (its test, then the benchmark with the fla peer), the decode config sweep at B >= 64, and the engine's
# decode throughput on 35B-A3B shapes. Everything lands in $OUT/res.tgz (the device returns <= 8 files).
. tools/device_env.sh >/dev/null
FINAL=${OUT:-/tmp/out}
export OUT=/tmp/res
mkdir -p $OUT
T_KERNELS=200 T_ENGINE=170 bash tools/gpu_tests.sh 2>&1 | tail -8
timeout 150 python3 -m linrnn_serve bench kernels --only gdn-decode --timeout-factor 2 --results-dir $OUT/k 2>&1 \
  | grep -vE "Warning|warner" | tail -25
timeout 100 python3 -m linrnn_bench.kernels.gdn --out $OUT/sweep --prefill "" --batches 64,128,256 --no-peer \
  --hybrid "" --sweep 2>&1 | grep -E "Error|error|wrote|sweep B=64 f32"
timeout 150 python3 examples/decode_throughput.py --model qwen35moe-nvfp4 --load-format dummy --batch 1,32,128 \
  2>&1 | grep -vE "Warning|warn" | tail -8 | tee $OUT/decode_throughput.txt
tar czf $FINAL/res.tgz -C /tmp res
