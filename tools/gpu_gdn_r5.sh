#!/usr/bin/env bash
# GDN decode, bf16 partition round 5 (issue #15 item 4): one device call (repo root as cwd; ~2.5 minutes, timeout_s 240).
# main's kernel (before this round) is benchmarks/results/kernels/gdn-decode/bf16_round5/variants/decode_main.py.txt,
# placed as kernels/gdn/decode_main.py (sweep) or over kernels/gdn/decode.py (old registry run, then restored).
#   tests  pytest -m gpu: the decode cases of tests/test_gdn_kernels.py (35B-A3B shapes, bf16 / hybrid / f32 vs the
#          naive reference, NaN-poisoned; every DECODE_SWEEP config) and tests/test_hybrid_state.py (tau = inf
#          bit-identical to the all-f32 engine, prefill -> decode, padded rows)
#   bench  the gdn-decode registry benchmark at B = 32..256 (all-f32, all-bf16, 50 % f32) for this tree ("new") and
#          for main's kernel ("old") in this call, and the #15 target lines for both -> targets.log
#   sweep  tools/gdn_r5_sweep.py: this kernel checked vs the naive reference and main (bit for bit), then timed
#          against main interleaved in one run, also with the graph's CPU launch off the clock ("queued")
#   ncu    Nsight Compute (--clock-control none), one eager call each at B = 64: warp stall reasons per issued
#          instruction, throughputs, occupancy -> ncu.txt
#   bash tools/gpu_gdn_r5.sh [tests,bench,sweep,ncu]     (env: MAIN, the old kernel file; ROUND, the results dir under
#   $OUT; TESTS_TIMEOUT, SWEEP_TIMEOUT, SWEEP_ARGS, NCU_TIMEOUT, NCU_CASES: tools/gpu_gdn_r6.sh sets them for round 6)
. tools/device_env.sh >/dev/null
STAGES=${1:-tests,bench,sweep,ncu}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
R=${OUT:-/tmp/out}/${ROUND:-r5}
mkdir -p $R
echo "commit ${LINRNN_COMMIT:-?}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
MAIN=${MAIN:-benchmarks/results/kernels/gdn-decode/bf16_round5/variants/decode_main.py.txt}
if has tests; then
  timeout ${TESTS_TIMEOUT:-70} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gdn_kernels.py -k "decode" \
    tests/test_hybrid_state.py -n 4 2>&1 | tail -4 | tee $R/tests.log
fi
if has bench; then
  GDN="python3 -m linrnn_bench.kernels.gdn --prefill '' --no-peer --hybrid 0.5 --batches 32,64,128,256"
  eval timeout 45 $GDN --out $R/new 2>&1 | grep -vE "Warning|warn" | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" \
    | tee $R/new.log
  cp kernels/gdn/decode.py /tmp/decode_new.py && cp $MAIN kernels/gdn/decode.py
  eval timeout 45 $GDN --out $R/old 2>&1 | grep -vE "Warning|warn" | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" \
    | tee $R/old.log
  cp /tmp/decode_new.py kernels/gdn/decode.py
  python3 - $R <<'PY' 2>&1 | tee $R/targets.log
import json, os, sys
for n in ("new", "old"):
    p = os.path.join(sys.argv[1], n, "gdn_decode.json")
    if not os.path.exists(p):
        continue
    res = json.load(open(p))
    for row in res["decode"]:
        m, copy = row["modes"], res["copy_gbs"]
        bf, f32, hyb = m["0.0"], m["1.0"], m.get("0.5", {})
        pct = 100 * bf["gbs"] / copy
        ratio = f32["us"] / hyb["us"] if "us" in hyb else float("nan")
        print(f"{n} B={row['B']} (copy {copy:.0f} GB/s): all-bf16 {bf['us']:.1f} us = {pct:.1f} % of copy (target >= 85"
              f"{' at B >= 64: ' + ('PASS' if pct >= 85 else 'MISS') if row['B'] >= 64 else ''}); all-f32 "
              f"{f32['us']:.1f} us = {100 * f32['gbs'] / copy:.1f} %; 50 % f32 {hyb.get('us', float('nan')):.1f} us = "
              f"{ratio:.3f}x all-f32 (target >= 1.25{': ' + ('PASS' if ratio >= 1.25 else 'MISS') if row['B'] >= 64 else ''})")
PY
fi
cp $MAIN kernels/gdn/decode_main.py
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-70} python3 tools/gdn_r5_sweep.py --out $R ${SWEEP_ARGS:-} 2>&1 | grep -vE "Warning|warn" \
    > $R/sweep.log
  grep -E "FAIL|ERROR|Error|Traceback|copy bandwidth|^f32=" $R/sweep.log
  echo "check: $(grep -c '^ok' $R/sweep.log) ok, $(grep -c '^FAIL' $R/sweep.log) FAIL"
fi
if has ncu; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  # each case: 3 eager calls (the first compiles), all profiled; the summary keeps the last of each
  timeout ${NCU_TIMEOUT:-30} $NCU --clock-control none -k regex:_gdn_decode_kernel --section SpeedOfLight \
    --section Occupancy --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 tools/gdn_r5_sweep.py --ncu-case "${NCU_CASES:-new,0.0,64;main,0.0,64;main,1.0,64}" > $R/ncu.txt 2>&1
  echo "ncu rc=$?"
  python3 - $R/ncu.txt <<'PY'
import re, sys
txt = open(sys.argv[1]).read()
blocks = re.split(r"\n  _gdn_decode_kernel", txt)[1:]
cases = re.findall(r"ncu case (.*)", txt)
for i, b in enumerate(blocks):
    if i % 3 != 2:
        continue
    vals = {m.group(1): m.group(2).replace(",", "") for m in re.finditer(r"stalled_(\w+?)_per_issue_active\.ratio[ \t]+(?:[^\d\s]\S*[ \t]+)?([\d.,]+)[ \t]*$", b, re.M)}
    top = sorted(((float(v), k) for k, v in vals.items()), reverse=True)[:8]
    dur = re.search(r"Duration\s+\S+\s+([\d.,]+)", b)
    clk = re.search(r"SM Frequency\s+\S+\s+([\d.]+)", b)
    dram = re.search(r"DRAM Throughput\s+%\s+([\d.]+)", b)
    occ = re.search(r"Achieved Occupancy\s+%\s+([\d.]+)", b)
    print(f"{cases[i // 3] if i // 3 < len(cases) else '?'}: {dur and dur.group(1)} us, SM {clk and clk.group(1)} GHz, DRAM "
          f"{dram and dram.group(1)} %, occupancy {occ and occ.group(1)} %; stalls per issue: "
          + ", ".join(f"{k} {v:.2f}" for v, k in top))
PY
fi
rm -f kernels/gdn/decode_main.py
