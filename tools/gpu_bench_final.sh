#!/usr/bin/env bash
# Final device call: batched decode (bf16 / NVFP4 all-f32 / NVFP4 at the KL-gated tau), the decode
# throughput example, then the GPU test pass. Results under $OUT.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
timeout 200 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,32,64,128 \
  --config "model=qwen35moe-bf16,label=bf16 f32" --config "model=qwen35moe-nvfp4,label=nvfp4 f32" \
  --config "model=qwen35moe-nvfp4,ssm-bf16-tau=16,label=nvfp4 tau=16" --vllm-ref --profile 1,128 --no-progress \
  --out $OUT/batched 2>&1 | grep -vE "Warning|^\[" | tail -75
timeout 120 python3 examples/decode_throughput.py --model qwen35moe-nvfp4 --load-format dummy --batch 1,32,128 2>&1 \
  | tee $OUT/decode_throughput.txt | tail -12
T_KERNELS=230 T_ENGINE=140 bash tools/gpu_tests.sh > /tmp/tests.txt 2>&1; tail -45 /tmp/tests.txt
tar czf $OUT/tests.tgz -C $OUT gpu_kernel_tests.log gpu_engine_tests.log 2>/dev/null; rm -f $OUT/*.xml $OUT/gpu_*.log
