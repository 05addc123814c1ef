#!/usr/bin/env bash
# GDN decode bf16 partition (issue #15 item 4), one device call (repo root as cwd). Stages:
#   sweep    tools/gdn_bf16_sweep.py (round $ROUND): correctness of each variant vs the naive reference, all-f32
#            new == old bit for bit, then old vs new variants at B = 32..256 (0 / 50 / 100 % f32) with copy bandwidth
#   ncu      Nsight Compute sections of old / new decode launches at B = 128 (if ncu is installed)
# The old kernel must sit beside the new one as kernels/gdn/decode_main.py (git show main:kernels/gdn/decode.py).
#   bash tools/gpu_gdn_bf16.sh [sweep,ncu]
. tools/device_env.sh >/dev/null
STAGES=${1:-sweep}
R=${OUT:-/tmp/out}/bf16
mkdir -p $R
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if has sweep; then
  timeout 110 python3 tools/gdn_bf16_sweep.py --round ${ROUND:-1} --out $R 2>&1 | grep -vE "Warning|warn" | tee $R/sweep.log | tail -60
fi
if has ncu; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: ${NCU:-not found}"
  if [ -n "$NCU" ]; then
    timeout 70 $NCU -k regex:_gdn_decode_kernel -c 10 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats python3 tools/gdn_ncu_probe.py > $R/ncu.txt 2>&1
    grep -E "decode|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|L2 Hit|Mem Busy|Max Bandwidth|Warp Cycles Per Issued|Issued Ipc|Theoretical Occ|Block Limit" $R/ncu.txt | head -150
  fi
fi
