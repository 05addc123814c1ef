#!/usr/bin/env bash
# GDN decode, bf16 partition round 4 (issue #15 item 4): one device call (repo root as cwd; ~3 minutes, timeout_s 240).
# tools/gdn_r4_sweep.py: every variant checked vs the naive reference (NaN-poisoned unused slots) and vs the current
# kernel (bit identity where the tile is the same), then timed against the current kernel in one run: all-bf16,
# 50 % f32 (one partition-major launch and "split" = one launch per partition), all-f32 (current only), B = 64,
# 128, 256, 32; better of two interleaved passes, % of the copy bandwidth of the same run. Results: $OUT/r4.
#   bash tools/gpu_gdn_r4.sh
. tools/device_env.sh >/dev/null
R=${OUT:-/tmp/out}/r4
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${SWEEP_TIMEOUT:-200} python3 tools/gdn_r4_sweep.py --out $R ${SWEEP_ARGS:-} 2>&1 | grep -vE "Warning|warn" \
  | tee $R/sweep.log | grep -E "FAIL|ERROR|Error|Traceback|copy bandwidth|^f32="
echo "check: $(grep -c '^ok' $R/sweep.log) ok, $(grep -c '^FAIL' $R/sweep.log) FAIL"
