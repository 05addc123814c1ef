#!/usr/bin/env bash
# GDN decode, blocked bf16 state layout (issue #15 item 4, bf16_round3): one device call (repo root as cwd; ~4 minutes,
# timeout_s 300). The kernels before the layout change (main at c09fc30, kept as benchmarks/results/kernels/gdn-decode/
# bf16_round3/variants/*_before.py.txt) are placed beside the current ones as
# kernels/gdn/{decode,prefill,common}_main.py. Stages, in this order:
#   check    tools/gdn_bf16_check.py on $CONFIGS: decode (0 / 50 / 100 % f32 heads, B = 1, 8, 64, 256) and prefill
#            (varlen) vs the naive reference (NaN-poisoned unused slots must stay NaN) and vs the old kernels with the
#            same tiles, bit for bit (only addresses changed: all-f32 must be bit-identical, and so must bf16 heads)
#   bench    the gdn-decode registry benchmark (python -m linrnn_bench.kernels.gdn, decode only, no fla peer),
#            all-f32 / all-bf16 / 50 % f32 at B = 1..256, % of copy of the same run, for the new kernel
#            (-> $OUT/bf16/default) and then the code before (-> $OUT/bf16/old: its kernels, naive reference and
#            benchmark swapped in, then restored), and the issue's two kernel target lines
#            for both (all-bf16 % of copy, 50 % f32 vs all-f32) -> $OUT/bf16/targets.log
#   engine   bench batched, 35B-A3B NVFP4 dummy, f32 state vs ssm-bf16-tau=16 in one run, npl 64 and 128
#   tests    pytest -m gpu on the GDN kernel and hybrid-state tests (compiled kernels vs the naive reference at 35B-A3B
#            shapes, prefill -> decode continuity, rows independent)
# Prints the tables; everything lands under $OUT/bf16.
#   bash tools/gpu_gdn_bf16.sh [check,bench,engine,tests]
. tools/device_env.sh >/dev/null
STAGES=${1:-check,bench,engine,tests}
R=${OUT:-/tmp/out}/bf16
mkdir -p $R
has() { [[ ",$STAGES," == *",$1,"* ]]; }
V=benchmarks/results/kernels/gdn-decode/bf16_round3/variants
for m in decode prefill common; do
  sed 's/linrnn_kernels.gdn.common import/linrnn_kernels.gdn.common_main import/' $V/${m}_before.py.txt > kernels/gdn/${m}_main.py
done
# the old decode kernel runs on the current check_pools / head_state_offset (the state content is in its layout)
sed -i 's/linrnn_kernels.gdn.common_main import/linrnn_kernels.gdn.common import/' kernels/gdn/decode_main.py
CONFIGS=${CONFIGS:-"[None, (64, 4, 'evict_first', 'evict_first'), (32, 2, 'evict_first', 'evict_first')]"}
GDN="python3 -m linrnn_bench.kernels.gdn --prefill '' --no-peer --hybrid 0.5 --batches 1,8,32,64,128,256"
if has check; then
  timeout 60 python3 tools/gdn_bf16_check.py --configs "$CONFIGS" 2>&1 | grep -vE "Warning|warn" > $R/check.log
  grep -E "FAIL|Error|Traceback|bit: False" $R/check.log | head -30
  echo "check: $(grep -c '^ok' $R/check.log) ok, $(grep -c '^FAIL' $R/check.log) FAIL," \
    "$(grep -c 'bit: True' $R/check.log) bit-identical to the old kernel"
fi
if has bench; then
  eval timeout 50 $GDN --out $R/default 2>&1 | grep -vE "Warning|warn" | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" \
    | tee $R/default.log
  # the same benchmark on the code before the layout change (kernels, naive reference, benchmark), then restored
  OLD="kernels/gdn/decode.py kernels/gdn/prefill.py kernels/gdn/common.py kernels/gdn/naive.py benchmarks/kernels/gdn.py"
  mkdir -p /tmp/gdn_new && for f in $OLD; do cp $f /tmp/gdn_new/$(basename $f); done
  for f in $OLD; do b=$(basename $f .py); cp $V/$([ $b = gdn ] && echo bench_gdn || echo $b)_before.py.txt $f; done
  eval timeout 50 $GDN --out $R/old 2>&1 | grep -vE "Warning|warn" | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" \
    | tee $R/old.log
  for f in $OLD; do cp /tmp/gdn_new/$(basename $f) $f; done
  python3 - $R <<'PY' 2>&1 | tee $R/targets.log
import json, os, sys
runs = {n: json.load(open(p)) for n in ("default", "old")
        if os.path.exists(p := os.path.join(sys.argv[1], n, "gdn_decode.json"))}
for n, res in runs.items():
    for row in res["decode"]:
        if row["B"] < 64:
            continue
        m, copy = row["modes"], res["copy_gbs"]
        bf, f32, hyb = m["0.0"], m["1.0"], m.get("0.5", {})
        pct = 100 * bf["gbs"] / copy
        ratio = f32["us"] / hyb["us"] if "us" in hyb else float("nan")
        print(f"{n} B={row['B']}: all-bf16 {bf['us']:.1f} us = {pct:.1f} % of copy (target >= 85: "
              f"{'PASS' if pct >= 85 else 'MISS'}); all-f32 {f32['us']:.1f} us = {100 * f32['gbs'] / copy:.1f} %; "
              f"50 % f32 {hyb.get('us', float('nan')):.1f} us = {ratio:.3f}x all-f32 (target >= 1.25: "
              f"{'PASS' if ratio >= 1.25 else 'MISS'})")
PY
fi
if has engine; then
  timeout 110 python3 -m linrnn_serve bench batched --load-format dummy \
    --npp 128 --ntg 128 --npl 64,128 --config 'model=qwen35moe-nvfp4,label=nvfp4 f32' \
    --config 'model=qwen35moe-nvfp4,ssm-bf16-tau=16,label=nvfp4 tau=16' --no-progress --out $R/batched 2>&1 \
    | grep -vE "Warning|warn" | tee $R/batched.log | tail -12
fi
rm -f kernels/gdn/{decode,prefill,common}_main.py
if has tests; then
  timeout ${TESTS_TIMEOUT:-60} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gdn_kernels.py \
    tests/test_hybrid_state.py -n 4 2>&1 | tail -3 | tee $R/tests.log
fi
