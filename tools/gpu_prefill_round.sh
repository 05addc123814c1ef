#!/usr/bin/env bash
# Prefill round (issue #14 c = 64 line), one H200 call; pass LINRNN_COMMIT=<sha>; timeout_s 300.
# MODE=profile (first call):
#   A. bench batched --npl 64,128 (PP = TG = 128) with --max-num-batched-tokens 8192: T_PP / S_PP / S_TG
#   B. tools/prefill_probe.py: one prefill forward of 2048 and 8192 tokens (16 / 64 x 128-token prompts):
#      wall, host, kernel ms per component against its floor, top kernels, graph replay
#   C. the same bench batched with --max-num-batched-tokens 2048
# Every stage has its own timeout; $OUT/prefill_report.md, JSON beside it.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=$OUT; mkdir -p $W
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
batched() {  # $1 budget, $2 timeout
  timeout $2 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl ${NPL:-64,128} \
    --max-num-batched-tokens $1 --config "model=qwen35moe-nvfp4" --no-progress --out $W/batched_$1 \
    > $W/batched_$1.log 2>&1
  echo "[$SECONDS s] batched budget $1: rc $?" | tee -a $W/report.md
  grep -A6 "| PP" $W/batched_$1/batched.md 2>/dev/null | head -6 | tee -a $W/report.md
}
batched 8192 ${TA:-110}
timeout ${TB:-85} python3 tools/prefill_probe.py --tokens 2048,8192 --prompt-len 128 --json $W/probe.json \
  > $W/probe.log 2>&1
echo "[$SECONDS s] probe: rc $?" | tee -a $W/report.md
grep -v "^\[" $W/probe.log | grep -E "^\||^device|^\{" | cut -c1-200 >> $W/report.md
batched 2048 ${TC:-90}
cat $W/report.md
