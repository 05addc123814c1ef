#!/usr/bin/env bash
# The multi-process CUDA path of tensor / expert parallelism on ONE GPU (nvidia-h200 or h100, ~2-3 min):
# tests/test_tensor_parallel_gpu.py runs TP1, TP2 and EP2 of a 4-layer Qwen3.5-35B-A3B-shaped NVFP4 dummy with
# LINRNN_TP_SINGLE_DEVICE=1 (both ranks on cuda:0, gloo over host copies, CUDA graphs off for TP2 / EP2) and
# checks greedy streams (differences only at near-ties) and logits within bf16 tolerance against TP1, plus
# every rank's stage log reaching "ready". Prints the comparison table; the pytest log in $OUT.
# First, the NCCL-specific parts that one GPU can run: a 1-rank NCCL group bound to the device, all-reduce and
# all-gather captured in a CUDA graph through torch.distributed and replayed, then the group aborted
# (tools/nccl_probe.py --ranks 1 --graph; NCCL refuses two ranks on one GPU).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 30 python3 -m tools.nccl_probe --ranks 1 --max-bytes $((1 << 20)) --iters 5 --graph \
  --out "$OUT/nccl_probe_1.json" 2>&1 | grep -E "^\||^all|probe rank 0.*(graph|done)|Error|error"
echo "nccl probe exit status ${PIPESTATUS[0]}"
timeout 150 python3 -m pytest -m gpu tests/test_tensor_parallel_gpu.py -q -rP -p no:cacheprovider --timeout 145 \
  > "$OUT/gpu_tp_single.log" 2>&1
echo "pytest exit status $?"
grep -E "^\||passed|failed|error|Error|exit status|ready in" "$OUT/gpu_tp_single.log" | head -40
