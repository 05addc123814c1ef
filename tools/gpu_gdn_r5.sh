#!/usr/bin/env bash
# GDN decode, bf16 partition round 5 (issue #15 item 4): one device call (repo root as cwd; ~3 minutes, timeout_s 240).
#   ncu    Nsight Compute (--clock-control none) of one eager call at B = 64: main's kernel all-bf16 and all-f32,
#          the tensor-core bf16 tile (bf16_mma) all-bf16 -> $OUT/r5/ncu.txt (+ a summary line per metric)
#   sweep  tools/gdn_r5_sweep.py: variants checked vs the naive reference and main's kernel, then timed against
#          it in one run (% of this run's copy bandwidth) -> $OUT/r5/sweep.log, r5_sweep.json
# main's kernel (before this round) is benchmarks/results/kernels/gdn-decode/bf16_round5/variants/decode_main.py.txt,
# placed as kernels/gdn/decode_main.py for the run.
#   bash tools/gpu_gdn_r5.sh [ncu,sweep]
. tools/device_env.sh >/dev/null
STAGES=${1:-ncu,sweep}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
R=${OUT:-/tmp/out}/r5
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
cp benchmarks/results/kernels/gdn-decode/bf16_round5/variants/decode_main.py.txt kernels/gdn/decode_main.py
if has ncu; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: ${NCU:-not found}"
  if [ -n "$NCU" ]; then
    # each case: 3 eager calls (the first compiles); all are profiled, the summary reads the last of each
    timeout ${NCU_TIMEOUT:-75} $NCU --clock-control none -k regex:_gdn_decode_kernel \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis \
      python3 tools/gdn_r5_sweep.py --ncu-case "main,0.0,64;main,1.0,64;mma,0.0,64" > $R/ncu.txt 2>&1
    echo "ncu rc=$?"
    grep -E "ncu case|^  _gdn|Duration  |DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Issued Warp Per|No Eligible|Warp Cycles Per Issued|L2 Hit Rate |Executed Ipc A|Block Limit Reg|Block Limit Sh|Dynamic Shared|SM Frequency" \
      $R/ncu.txt | tail -80
  fi
fi
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-150} python3 tools/gdn_r5_sweep.py --out $R ${SWEEP_ARGS:-} 2>&1 | grep -vE "Warning|warn" \
    | tee $R/sweep.log | grep -E "FAIL|ERROR|Error|Traceback|copy bandwidth|^f32="
  echo "check: $(grep -c '^ok' $R/sweep.log) ok, $(grep -c '^FAIL' $R/sweep.log) FAIL"
fi
rm -f kernels/gdn/decode_main.py
