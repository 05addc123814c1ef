#!/usr/bin/env bash
# Issue 17 on one GPU (nvidia-h100-x1 or nvidia-h200): structured output keeps CUDA graphs and costs
# little. Prints short tables; results under $OUT.
#   1. pytest -m gpu tests/test_structured_gpu.py: a constrained batch (JSON schema) decodes with the
#      captured "step" + "mask" graphs (graphs on), gives valid JSON, and the free rows of the same batch
#      are identical to graphs off
#   2. bench batched, Qwen3.5-35B-A3B NVFP4 dummy, npl 1,8,32,64: each row then the same batch with every
#      sequence under a JSON grammar (--structured-output): ms/step and "+x % vs unconstrained"
#      (acceptance: <= 10 % at npl 32)
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
echo "== 1. constrained decode under CUDA graphs"
timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_structured_gpu.py 2>&1 | tail -5 \
  | tee "$OUT/structured_gpu.txt"
echo "== 2. grammar-mask cost (bench batched --structured-output)"
timeout 1800 python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg 128 \
  --npl 1,8,32,64 --structured-output --no-progress --out "$OUT/batched_so" 2>&1 \
  | grep -E "^\||structured output|FAILED|Error" | tee "$OUT/batched_so.txt"
