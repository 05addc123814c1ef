#!/usr/bin/env bash
# Nsight Compute of the NVFP4 MMA kernel's gate_up and down launches (issue #13, round 7): speed of light, occupancy,
# launch, scheduler and warp-state statistics (stall reasons), memory workload, at BS (default 64,128,256).
# One device call (timeout_s ~300): LINRNN_COMMIT=<sha> bash tools/gpu_moe_ncu.sh  -> $OUT/moe_ncu/ncu.txt, summary.txt
# MODE=source: the warp-state samples per SASS instruction instead (SourceCounters; BS default 128,256)
#   -> $OUT/moe_ncu/source.csv (every profiled launch; tools/moe_ncu_source.py reads it)
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/moe_ncu
mkdir -p $R
echo "commit ${LINRNN_COMMIT:-?}"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -z "$NCU" ] && { echo "no ncu"; exit 1; }
if [ "${MODE:-}" = source ]; then  # per-SASS-instruction warp-state samples (which load each stalled warp waits on)
  timeout ${NCU_TIMEOUT:-240} $NCU --clock-control none --profile-from-start off -k regex:_nvfp4_mma_kernel \
    --section SourceCounters --section WarpStateStats -f -o $R/source \
    python3 tools/moe_ncu_probe.py "${BS:-128,256}" "${KW:-{}}" > $R/ncu_source.log 2>&1
  echo "ncu rc=$?"
  $NCU -i $R/source.ncu-rep --page source --csv --print-source sass > $R/source.csv 2> $R/source_export.log
  echo "export rc=$? $(wc -l < $R/source.csv) lines"; head -c 600 $R/source.csv; echo
  exit 0
fi
timeout ${NCU_TIMEOUT:-240} $NCU --clock-control none --profile-from-start off -k regex:_nvfp4_mma_kernel \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,lts__t_sector_hit_rate.pct" \
  python3 tools/moe_ncu_probe.py "${BS:-64,128,256}" "${KW:-{}}" > $R/ncu.txt 2>&1
echo "ncu rc=$?"
python3 - $R/ncu.txt > $R/summary.txt <<'PY'
import re, sys
txt = open(sys.argv[1]).read()
blocks = re.split(r"\n  _nvfp4_mma_kernel", txt)[1:]
cases = re.findall(r"ncu case (\d+)", txt)
for i, b in enumerate(blocks):
    grid = re.search(r"\((\d+), (\d+), 1\)x\((\d+)", b)
    vals = {m.group(1): m.group(2).replace(",", "") for m in re.finditer(
        r"stalled_(\w+?)_per_issue_active\.ratio[ \t]+(?:[^\d\s]\S*[ \t]+)?([\d.,]+)[ \t]*$", b, re.M)}
    top = sorted(((float(v), k) for k, v in vals.items()), reverse=True)[:7]
    def f(pat):
        m = re.search(pat, b)
        return m.group(1).replace(",", "") if m else "?"
    which = "gate_up" if i % 2 == 0 else "down"
    print(f"B={cases[i // 4] if i // 4 < len(cases) else '?'} {which} grid {grid and grid.groups()}: "
          f"{f(r'Duration\s+\S+\s+([\d.,]+)')} us, DRAM {f(r'DRAM Throughput\s+%\s+([\d.]+)')} %, "
          f"read {f(r'dram__bytes_read.sum\s+\S+\s+([\d.,]+)')} {f(r'dram__bytes_read.sum\s+(\S+)')}, "
          f"L2 hit {f(r'lts__t_sector_hit_rate.pct\s+%\s+([\d.]+)')} %, L1 {f(r'L1/TEX Cache Throughput\s+%\s+([\d.]+)')} %, "
          f"L2 {f(r'L2 Cache Throughput\s+%\s+([\d.]+)')} %, occupancy {f(r'Achieved Occupancy\s+%\s+([\d.]+)')} % "
          f"(theor. {f(r'Theoretical Occupancy\s+%\s+([\d.]+)')}), regs {f(r'Registers Per Thread\s+\S+\s+([\d.]+)')}, "
          f"issue active {f(r'Issue Slots Busy\s+%\s+([\d.]+)')} %, eligible warps {f(r'Eligible Warps Per Scheduler\s+warp\s+([\d.]+)')}, "
          f"active warps {f(r'Active Warps Per Scheduler\s+warp\s+([\d.]+)')}; stalls/issue: "
          + ", ".join(f"{k} {v:.2f}" for v, k in top))
PY
cat $R/summary.txt
