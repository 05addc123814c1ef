#!/usr/bin/env bash
# NVFP4 MMA kernel round 3 (issue #13 kernel lines), one device call (<= 6 min): the packed layout that makes
# natural-order activations ready MMA B pairs (2.41 SASS instructions per weight at the 8-token tile, was 2.92).
#   1. GPU tests of the MMA-fragment decode path and of the wgmma prefill path (same packed layout): equality with
#      `naive` on exactly dequantized weights for B in {1,2,3,8,31,64,128,255,256,2048} and loads 0/1/7/8/9/15/16/17,
#      NaN-poisoned outputs, every split-K path, bitwise run to run and across CUDA-graph replays
#   2. the `moe` registry entry: old kernel (nvfp4/asm), new (nvfp4/mma), bf16, copy bandwidth in the same run,
#      instructions per weight beside each row, per-kernel profile (routed-GEMM % of copy), the 8- vs 16-token tile
#   3. the engine's graphs-on == graphs-off greedy test on NVFP4 A3B-shaped models (B = 1, 64)
# Pass the real commit: LINRNN_COMMIT=<sha> bash tools/gpu_mma_r3.sh. Results under $OUT/mma_r3.
# Env: T_TESTS / T_BENCH / T_ENGINE (stage timeouts, s), REP (do_bench ms), CANDIDATES (MMA sweep keys, comma-separated),
# CHECKPOINT_TESTS=1 (also the NVFP4 checkpoint GPU tests, ModelOpt and compressed-tensors, on the MMA path).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/mma_r3
mkdir -p $R
python3 -c "import triton; print('triton', triton.__version__)"
timeout ${T_TESTS:-110} python3 -m pytest -q -m gpu tests/test_nvfp4_mma.py tests/test_nvfp4_wgmma.py -p no:cacheprovider \
  --junitxml=$R/test_nvfp4_mma_wgmma_gpu.xml 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -12
timeout ${T_BENCH:-170} python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma,nvfp4/asm,bf16/ours \
  --sets 3 --rep ${REP:-100} --profile --mma-sweep --mma-candidates "${CANDIDATES:-default,8-token blocks,16-token blocks,hint none,2 units per step}" \
  --out $R 2>&1 | grep -vE "leaked|nanobind|^ - |Warning|warn|^\{|^profile|^mma sweep" | tail -40
timeout ${T_ENGINE:-60} python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml=$R/test_engine_graphs_gpu.xml \
  "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]" \
  2>&1 | grep -vE "leaked|nanobind|^ - " | tail -5
if [ -n "${CHECKPOINT_TESTS:-}" ]; then  # the NVFP4 checkpoint GPU tests (ModelOpt, compressed-tensors) on the MMA path
  timeout ${T_CHECKPOINT:-90} python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml=$R/test_quant_checkpoints_gpu.xml \
    tests/test_quant_checkpoints.py -k quantized_checkpoint_on_gpu 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -5
fi
