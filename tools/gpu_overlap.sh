#!/usr/bin/env bash
# Overlapped steps (#14 build items 2-3) on one GPU, about 5 minutes on an H200:
#  (1) tests/test_overlap_gpu.py: no blocking device sync in steady-state decode steps
#      (torch.cuda.set_sync_debug_mode("error")), overlapped == synchronous greedy / seeded streams with
#      CUDA graphs (tiny model and a 4-layer 35B-A3B-shaped NVFP4 model);
#  (2) `bench batched` on the 35B NVFP4 dummy, PP 128 / TG 128 / npl 1, 8, 128, overlapped steps and
#      synchronous steps side by side in one process (same weights): the "host gap ms/step" column is
#      timed ms/step minus the profiled kernel ms/step at B = 1 and 128 (targets <= 0.15 / <= 0.4 ms).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LINRNN_WARMUP=0 timeout 150 python3 -m pytest -q -m gpu tests/test_overlap_gpu.py -x 2>&1 | tail -4
timeout 210 python3 -m linrnn_serve bench batched --npp 128 --ntg 128 --npl 1,8,128 --profile 1,128 --profile-steps 20 \
  --config model=qwen35moe-nvfp4,load-format=dummy,async-scheduling=false \
  --config model=qwen35moe-nvfp4,load-format=dummy,async-scheduling=true \
  --out "$OUT/batched_overlap" 2>&1 | grep -E "^\||^#|profile:"
