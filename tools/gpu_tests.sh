#!/usr/bin/env bash
# The GPU test pass in one device call (repo root as cwd; logs under $OUT).
# Kernel test files run whole (their CPU-shaped tests run compiled on CUDA too), several files at once;
# the engine / server / checkpoint GPU tests run after, one at a time (they size GPU memory).
. tools/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}
K="tests/test_norm_kernels.py tests/test_gdn_kernels.py tests/test_hybrid_state.py tests/test_attention_kernels.py
   tests/test_moe_kernels.py tests/test_nvfp4_mma.py tests/test_quant_linear.py"
timeout "${T_KERNELS:-330}" python3 -m pytest $K -n 8 --dist loadfile -q -p no:cacheprovider -rfE --timeout 300 \
  --junitxml="$OUT/gpu_kernel_tests.xml" 2>&1 | tee "$OUT/gpu_kernel_tests.log" | grep -vE "^(PASSED|SKIPPED)" | tail -80
timeout "${T_ENGINE:-220}" python3 -m pytest -m gpu tests/test_engine_gpu.py tests/test_quant_checkpoints.py \
  tests/test_tools.py tests/test_synth.py tests/test_server_e2e.py -k "not test_dummy_35b_on_gpu" -q -p no:cacheprovider \
  -rfE --timeout 200 --junitxml="$OUT/gpu_engine_tests.xml" 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -60
