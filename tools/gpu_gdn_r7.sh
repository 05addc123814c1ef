#!/usr/bin/env bash
# GDN decode, bf16 partition round 7 (issue #15 item 4): one device call (repo root as cwd; timeout_s 240): the stages
# of tools/gpu_gdn_r5.sh against main's kernel before round 7, results under $OUT/r7.
#   tests  pytest -m gpu: the decode cases of tests/test_gdn_kernels.py (35B-A3B shapes, bf16 / hybrid / f32 vs the
#          naive reference, NaN-poisoned; every DECODE_SWEEP config; the packed bf16 tile) and tests/test_hybrid_state.py
#          (tau = inf bit-identical to the all-f32 engine, prefill -> decode, padded rows)
#   bench  the gdn-decode registry benchmark at B = 32..256, this tree ("new") and main's kernel ("old"), + targets.log
#   sweep  tools/gdn_r5_sweep.py: its VARIANTS (round 7: the packed bf16 tile's launch shapes) checked vs the naive
#          reference and main, then timed against main interleaved in one run
#   bash tools/gpu_gdn_r7.sh [tests,bench,sweep]
MAIN=benchmarks/results/kernels/gdn-decode/bf16_round7/variants/decode_main.py.txt ROUND=r7 \
  TESTS_TIMEOUT=${TESTS_TIMEOUT:-70} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-150} bash tools/gpu_gdn_r5.sh "${1:-tests,bench,sweep}"
