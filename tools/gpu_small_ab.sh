#!/usr/bin/env bash
# fused (#15 kernels on) vs unfused decode, side by side in one device call (results in $OUT/ab.tgz)
. tools/device_env.sh >/dev/null
R=/tmp/ab; mkdir -p $R
B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,128 --vllm-ref --profile 1 --no-progress"
timeout 110 $B --config 'model=qwen35moe-nvfp4,label=fused (#15 kernels on)' --out $R/fused > $R/fused.log 2>&1
grep -E "^\| 128 \| 128|launches" $R/fused/batched.md | head -8
LINRNN_SKINNY_GEMM=0 LINRNN_FUSED_ROUTER=0 LINRNN_FUSED_ROPE_KV=0 timeout 100 $B --config 'model=qwen35moe-nvfp4,label=unfused' --out $R/unfused > $R/unfused.log 2>&1
grep -E "^\| 128 \| 128|launches" $R/unfused/batched.md | head -8
tar czf $OUT/ab.tgz -C /tmp ab
