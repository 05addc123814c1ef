#!/usr/bin/env bash
# Small-batch decode (#15) fused vs unfused, one device call (~6 min, repo root as cwd):
#   1. (unless SKIP_SWEEP=1) the gemv sweep -> a measured table (fused used per shape up to the M where it beat
#      the unfused chain), passed to the fused run as LINRNN_SKINNY_TABLE (else kernels/gemv/tuned.json)
#   2. bench batched, 35B-A3B NVFP4 dummy, f32 state, npl 1,8,128, profiles at npl 1 and 128: fusions on, then off
#   3. per-component tables of both profiles (benchmarks/step_components.py)
# Results in $OUT/ab.tgz; prints the rows, the profile lines and the component tables.
. tools/device_env.sh >/dev/null
R=/tmp/ab; mkdir -p $R; FINAL=${OUT:-/tmp/out}; mkdir -p $FINAL
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  mkdir -p $R/gemv
  timeout 200 python3 -m linrnn_bench.kernels.gemv --out $R/gemv 2>&1 | grep -vE "Warning|warn" > $R/gemv/sweep.log
  grep -E "precompiled|not timed" $R/gemv/sweep.log | head; grep -E "^Per decode|^max_m" $R/gemv/sweep.log
  [ -f $R/gemv/skinny_table.json ] && export LINRNN_SKINNY_TABLE=$R/gemv/skinny_table.json
fi
B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,128 --vllm-ref --profile 1,128 --profile-top 90 --no-progress"
LINRNN_SKINNY_GEMM=1 LINRNN_FUSED_ROUTER=1 LINRNN_FUSED_ROPE_KV=1 timeout 170 $B \
  --config 'model=qwen35moe-nvfp4,label=fused (#15 kernels on)' --out $R/fused > $R/fused.log 2>&1
grep -E "^\| 128 \| 128|^profile:|Error" $R/fused/batched.md $R/fused.log | head -8
LINRNN_SKINNY_GEMM=0 LINRNN_FUSED_ROUTER=0 LINRNN_FUSED_ROPE_KV=0 timeout 130 $B \
  --config 'model=qwen35moe-nvfp4,label=unfused' --out $R/unfused > $R/unfused.log 2>&1
grep -E "^\| 128 \| 128|^profile:|Error" $R/unfused/batched.md $R/unfused.log | head -8
for v in fused unfused; do
  [ -f $R/$v/batched.json ] && python3 -m linrnn_bench.step_components $R/$v/batched.json --out $R/$v/components.md
done
tar czf $FINAL/ab.tgz -C /tmp ab
