#!/usr/bin/env bash
# Skinny GEMM / fused router (#15) on the GPU, one device call (~3-4 min, repo root as cwd): the gemv GPU tests,
# then the per-shape sweep (benchmarks/kernels/gemv.py: fused vs the unfused chain vs cuBLAS, M in 1..32)
# -> $OUT/gemv/{gemv.md,gemv.json,skinny_table.json}. Prints the sweep's table last.
#   bash tools/gpu_gemv.sh [--only case,case]
. tools/device_env.sh >/dev/null
FINAL=${OUT:-/tmp/out}
mkdir -p $FINAL/gemv
timeout 150 python3 -m pytest tests/test_gemv_kernels.py -m gpu -q -p no:cacheprovider -rfE -x 2>&1 \
  | tee $FINAL/gemv/tests.log | tail -6
timeout 330 python3 -m linrnn_bench.kernels.gemv --out $FINAL/gemv "$@" 2>&1 | grep -vE "Warning|warn" \
  > $FINAL/gemv/sweep.log
grep -E "precompiled|failure|not timed|Error" $FINAL/gemv/sweep.log | head -20
sed -n '/^# Skinny/,$p' $FINAL/gemv/sweep.log
