#!/usr/bin/env bash
# GDN decode bf16 partition (issue #15 item 4), one device call (repo root as cwd; ~3 minutes).
#   sweep   tools/gdn_bf16_sweep.py: correctness of each variant vs the naive reference, all-f32 new == old
#           bit for bit, then old vs new variants at B = 32..256 (0 / 50 / 100 % f32 heads) with copy bandwidth
# The old kernel must sit beside the new one as kernels/gdn/decode_main.py (git show main:kernels/gdn/decode.py).
#   bash tools/gpu_gdn_bf16.sh [sweep]
. tools/device_env.sh >/dev/null
STAGES=${1:-sweep}
R=${OUT:-/tmp/out}/bf16
mkdir -p $R
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if has sweep; then
  timeout 175 python3 tools/gdn_bf16_sweep.py --out $R 2>&1 | grep -vE "Warning|warn" | tee $R/sweep.log | tail -80
fi
