#!/usr/bin/env bash
# Prefill bucket granularity A/B on one H200 (lead, session 5): the prefill-graph GPU tests with the new buckets,
# then #16's benefit run with caching on, four buckets per octave vs powers of two (LINRNN_PREFILL_BUCKETS=pow2),
# then the CPU host-overhead benchmark on this machine's 16 cores. Results under $OUT.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_graphs.py --timeout 140 2>&1 | tail -4 \
  | tee $OUT/prefill_graphs_gpu_tests.txt
el "tests"
OUT=$OUT TRACE=1 timeout 200 bash tools/gpu_prefix.sh on fine > $OUT/on_fine.log 2>&1
el "on fine"; tail -3 $OUT/prefix_multi_turn_fine.txt
OUT=$OUT LINRNN_PREFILL_BUCKETS=pow2 timeout 200 bash tools/gpu_prefix.sh on pow2 > $OUT/on_pow2.log 2>&1
el "on pow2"; tail -3 $OUT/prefix_multi_turn_pow2.txt
grep -h "captured" $OUT/prefix_server_fine.log $OUT/prefix_server_pow2.log
python3 - $OUT <<'PY'
import json, sys
o = sys.argv[1]
for l in ("fine", "pow2"):
    try:
        r = json.load(open(f"{o}/prefix_multi_turn_{l}.json"))["runs"][0]
    except Exception as e:
        print(l, "missing", e); continue
    print(f"| {l} | {r['ttft_ms_turns_2_plus']['median']:.1f} | " + " | ".join(f"{t['ttft_ms']['median']:.0f}" for t in r["turns"])
          + f" | {r['output_throughput']:.0f} | {r.get('failed')} |")
PY
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 150 python3 -m linrnn_bench.host_overhead --batch 1,128 --tokens 256 \
  --out $OUT/host_overhead > $OUT/host_overhead.log 2>&1
el "host overhead"; cat $OUT/host_overhead/host_overhead.md | tail -4
