#!/usr/bin/env bash
# Issue 17, structured output on one GPU (nvidia-h200; ~3-4 min). Results under $OUT (grammar.tgz + short tables).
#   1. pytest -m gpu tests/test_structured_gpu.py: constrained decode replays the captured "step" + "mask" graphs,
#      gives valid JSON and the same tokens as graphs off (constrained and free rows), and a constrained decode
#      step makes no more synchronizing CUDA calls than a free one
#   2. bench batched, Qwen3.5-35B-A3B NVFP4 dummy, npl 32: the batch unconstrained, then every row under a JSON
#      grammar (--structured-output): ms/step of both and the grammar-mask cost in % (acceptance: <= 10 %)
#   3. host time per decode step on this machine's CPU with the forward stubbed (benchmarks/host_overhead.py
#      --structured, B = 32, the 248k vocabulary): free vs constrained, the grammar fill (overlaps the forward)
#      and the exposed rest
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; R=/tmp/grammar; mkdir -p $R $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== 1. structured-output GPU tests"
timeout 150 python3 -m pytest -m gpu tests/test_structured_gpu.py -q -p no:cacheprovider -rfE > $R/tests.log 2>&1
echo "rc $?" >> $R/tests.log
tail -3 $R/tests.log; grep -E "^(FAILED|ERROR)|assert" $R/tests.log | head -8
el "tests done"
echo "== 2. grammar-mask cost, bench batched npl 32"
timeout 90 python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg 64 \
  --npl 32 --structured-output --no-progress --out $R/batched_so > $R/batched_so.log 2>&1
python3 - "$R/batched_so/batched.json" <<'PY'
import json, sys
try:
    c = json.load(open(sys.argv[1]))["configs"][0]
    free, so = c["rows"][0], c["structured_rows"][0]
except Exception as e:  # the bench failed: its log says why
    print(f"no result ({type(e).__name__}: {e}); see batched_so.log"); sys.exit(0)
pct = so["grammar_overhead_pct"]
print(f"| npl | unconstrained ms/step | JSON-constrained ms/step | cost | CUDA graphs | complete |")
print(f"|---:|---:|---:|---:|---|---|")
print(f"| {free['B']} | {free['ms_per_step']:.3f} | {so['ms_per_step']:.3f} | {pct:+.1f} % | {so.get('cuda_graphs')} | "
      f"{free['complete'] and so['complete']} |")
print(f"grammar-mask cost {pct:+.1f} % at npl 32: {'PASS' if pct <= 10 else 'FAIL'} (target <= 10 %)")
PY
grep -E "Error|Traceback" $R/batched_so.log | head -3
el "bench done"
echo "== 3. host time per decode step, stubbed forward (this host's CPU)"
timeout 60 python3 -m linrnn_bench.host_overhead --structured --batch 32 --tokens 256 --model qwen35moe-nvfp4 \
  --out $R/host > $R/host.log 2>&1
tail -2 $R/host.log
el "host done"
tar czf $OUT/grammar.tgz -C /tmp grammar
