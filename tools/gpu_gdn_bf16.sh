#!/usr/bin/env bash
# GDN decode, bf16 partition (issue #15 item 4, round 2): the final device call (repo root as cwd; ~5-6 minutes,
# timeout_s 480). The kernel before round 2 (main at 7d0ac74, kept as benchmarks/results/kernels/gdn-decode/
# bf16_round2/variants/decode_before.py.txt) is placed beside the new one as kernels/gdn/decode_main.py.
# Round 2 adds persistent TMA-pipelined bf16 programs (DecodeConfig.bf16_persistent / bf16_stages), off by
# default; LINRNN_GDN_BF16_PERSISTENT=$PERSISTENT ("programs per SM,stages", default 4,3) turns them on for
# the [Dk, 64] configs (B >= 17 at 35B-A3B shapes). Stages, in this order:
#   check    tools/gdn_bf16_check.py on $CONFIGS: vs the naive reference (NaN-poisoned unused slots must stay NaN)
#            and vs the old kernel with the same tile / hints, bit for bit (or the largest difference), at
#            0 / 50 / 100 % f32 heads, B = 1, 8, 64, 256
#   new      the gdn-decode registry benchmark (python -m linrnn_bench.kernels.gdn, decode only, no fla peer) with
#            LINRNN_GDN_BF16_PERSISTENT=$PERSISTENT: all-f32 / all-bf16 / 50 % f32 at B = 1..256, % of copy of the
#            same run -> $OUT/bf16/new
#   old      the same benchmark on decode_main.py (copied over decode.py in this device copy) -> $OUT/bf16/old
#   engine   bench batched, 35B-A3B NVFP4 dummy, f32 state vs ssm-bf16-tau=16 in one run, npl 64 and 128, with
#            LINRNN_GDN_BF16_PERSISTENT=$PERSISTENT (f32 heads never take the persistent path)
#   sweep    linrnn_bench.kernels.gdn_decode_probe: old kernel and the $SWEEP variants side by side at 0 / 50 %
#            f32 heads, B = 128, 64, 256 (two interleaved passes, a size-matched copy per row)
#   tests    pytest -k "gpu_decode or partition_major or persistent" (compiled kernels vs the naive reference at
#            35B-A3B shapes, the persistent configs at B = 64 included)
# Prints the tables; everything lands under $OUT/bf16.
#   bash tools/gpu_gdn_bf16.sh [check,new,old,engine,sweep,tests]
. tools/device_env.sh >/dev/null
STAGES=${1:-check,new,old,engine,sweep,tests}
R=${OUT:-/tmp/out}/bf16
mkdir -p $R
has() { [[ ",$STAGES," == *",$1,"* ]]; }
[ -f kernels/gdn/decode_main.py ] || cp benchmarks/results/kernels/gdn-decode/bf16_round2/variants/decode_before.py.txt \
  kernels/gdn/decode_main.py
PERSISTENT=${PERSISTENT:-4,3}
EF=evict_first
CONFIGS=${CONFIGS:-"[None, (64, 4, '$EF', '$EF', None, None, 4, 3), (64, 4, '$EF', '$EF', None, None, 3, 4)]"}
SWEEP=${SWEEP:-"[('decode_main', (64, 4, '$EF', '$EF')), ('decode', (64, 4, '$EF', '$EF', None, None, 4, 3)),
  ('decode', (64, 4, '$EF', '$EF', None, None, 3, 4)), ('decode', (64, 4, '$EF', '$EF', None, None, 4, 2)),
  ('decode', (64, 4, '$EF', '$EF', 168, None, 3, 3))]"}
GDN="python3 -m linrnn_bench.kernels.gdn --prefill '' --no-peer --hybrid 0.5 --batches 1,8,32,64,128,256"
if has check; then
  timeout 60 python3 tools/gdn_bf16_check.py --configs "$CONFIGS" 2>&1 | grep -vE "Warning|warn" > $R/check.log
  grep -E "FAIL|Error|Traceback|bit: False" $R/check.log | head -30
  echo "check: $(grep -c '^ok' $R/check.log) ok, $(grep -c '^FAIL' $R/check.log) FAIL," \
    "$(grep -c 'bit: True' $R/check.log) bit-identical to the old kernel"
fi
if has new; then
  eval LINRNN_GDN_BF16_PERSISTENT=$PERSISTENT timeout 50 $GDN --out $R/new 2>&1 | grep -vE "Warning|warn" \
    | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" | tee $R/new.log
fi
if has old; then
  cp kernels/gdn/decode.py /tmp/decode_new.py && cp kernels/gdn/decode_main.py kernels/gdn/decode.py
  eval timeout 45 $GDN --out $R/old 2>&1 | grep -vE "Warning|warn" | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" \
    | tee $R/old.log
  cp /tmp/decode_new.py kernels/gdn/decode.py
fi
if has new || has old; then  # the issue's two kernel targets, new vs old, from the registry JSONs of this call
  python3 - $R <<'PY' 2>&1 | tee $R/targets.log
import json, os, sys
runs = {n: json.load(open(p)) for n in ("old", "new")
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
  LINRNN_GDN_BF16_PERSISTENT=$PERSISTENT timeout 110 python3 -m linrnn_serve bench batched --load-format dummy \
    --npp 128 --ntg 128 --npl 64,128 --config 'model=qwen35moe-nvfp4,label=nvfp4 f32' \
    --config 'model=qwen35moe-nvfp4,ssm-bf16-tau=16,label=nvfp4 tau=16' --no-progress --out $R/batched 2>&1 \
    | grep -vE "Warning|warn" | tee $R/batched.log | tail -12
fi
if has sweep; then
  timeout ${SWEEP_S:-100} python3 -m linrnn_bench.kernels.gdn_decode_probe --batches ${SWEEP_B:-128,64,256} \
    --fractions 0.0,0.5 --variants "$SWEEP" --out $R/sweep 2>&1 | grep -vE "Warning|warn" | tee $R/sweep.log
fi
rm -f kernels/gdn/decode_main.py
if has tests; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_kernels.py \
    -k "gpu_decode or partition_major or persistent" -n 4 2>&1 | tail -3 | tee $R/tests.log
fi
