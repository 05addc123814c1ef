#!/usr/bin/env bash
# NVFP4 MoE decode kernel (issue #13), one device call: the GPU tests of the MMA-fragment path
# (tests/test_nvfp4_mma.py and tests/test_moe_kernels.py -m gpu, the routing kernels of tests/test_gemv_kernels.py),
# then the `moe` benchmark (old kernel, new kernel and bf16 in one
# run, copy bandwidth measured in the same run, instructions/weight from the sm_90 compile).
# Pass the real commit: LINRNN_COMMIT=<sha> bash tools/gpu_moe.sh. Results under $OUT/moe.
# Options (env): BENCH_ARGS="--mma-sweep --profile" (tile variants, per-kernel times), ENGINE_TESTS=1 (graphs-on ==
# graphs-off greedy decode of NVFP4 A3B-shaped models at B = 1 and 64), PREFILL=1 (B = 1024-4096:
# the dequantize-to-bf16 path vs the old kernel vs bf16, $OUT/moe_prefill), ENGINE=1 (bench batched, NVFP4 35B-A3B
# dummy, vLLM ratio, profile at npl 1 / 128, $OUT/batched), SKIP_DECODE=1 (no decode-size MoE benchmark).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
mkdir -p $OUT/moe
timeout ${T_TESTS:-240} python3 -m pytest -q -m gpu tests/test_nvfp4_mma.py tests/test_moe_kernels.py -p no:cacheprovider \
  --junitxml=$OUT/moe/test_nvfp4_mma_gpu.xml 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -15
# the routing kernels the decode layer uses (fused router; route + align from logits) on the device
timeout ${T_TESTS:-240} python3 -m pytest -q tests/test_gemv_kernels.py -k "route_align_logits or fused_router" \
  -p no:cacheprovider 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -5
if [ -n "${ENGINE_TESTS:-}" ]; then  # the engine's graphs-on == graphs-off greedy check, NVFP4 A3B shapes, B = 1 and 64
  timeout ${T_ENGINE_TESTS:-150} python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml=$OUT/moe/test_engine_gpu.xml \
    "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]" \
    2>&1 | grep -vE "leaked|nanobind|^ - " | tail -5
fi
[ -z "${SKIP_DECODE:-}" ] && timeout ${T_BENCH:-300} python3 -m linrnn_bench.kernels.moe --variants ${VARIANTS:-nvfp4/mma,nvfp4/mma-parts,nvfp4/asm,bf16/ours} \
  --sets 3 --rep ${REP:-150} ${BENCH_ARGS:-} --out $OUT/moe 2>&1 | grep -vE "leaked|nanobind|^ - |Warning|warn" | tail -40
if [ -n "${PREFILL:-}" ]; then  # large token counts: the dequantize-to-bf16 path vs the old kernel vs bf16
  timeout ${T_PREFILL:-150} python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma,nvfp4/asm,bf16/ours \
    --batch-sizes 2048,4096,8192 --sets 1 --rep 100 --out $OUT/moe_prefill 2>&1 \
    | grep -vE "leaked|nanobind|^ - |Warning|warn|^\{" | tail -14
fi
if [ -n "${ENGINE:-}" ]; then  # the engine: NVFP4 dummy 35B-A3B, batched decode vs vLLM 0.26, profile at npl 1 and 128
  timeout ${T_ENGINE:-200} python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 \
    --npl 1,8,32,64,128 --config "model=qwen35moe-nvfp4,label=nvfp4 f32" --vllm-ref --profile 1,128 --no-progress \
    --out $OUT/batched 2>&1 | grep -vE "Warning|^\[|leaked|nanobind|^ - " | tail -60
fi
