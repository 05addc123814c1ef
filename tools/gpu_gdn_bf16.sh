#!/usr/bin/env bash
# GDN decode, bf16 partition (issue #15 item 4): the final device call (repo root as cwd; ~3 minutes).
# The kernel before this work (aeb88d1, kept as benchmarks/results/kernels/gdn-decode/bf16_round/variants/
# decode_before.py.txt) is placed beside the new one as kernels/gdn/decode_main.py. Stages, in this order:
#   same     new kernel == old kernel bit for bit (outputs and both partitions) at 0 / 50 / 100 % f32 heads,
#            B = 1, 8, 64, 256, default configs, fresh inputs
#   new      the gdn-decode registry benchmark (python -m linrnn_bench.kernels.gdn, decode only, no fla peer):
#            all-f32 / all-bf16 / 50 % f32 at B = 1..256 with the copy bandwidth of the same run -> $OUT/bf16/new
#   engine   bench batched, 35B-A3B NVFP4 dummy, f32 state vs ssm-bf16-tau=16 in one run, npl 64 and 128
#   old      the same benchmark as `new` on decode_main.py (copied over decode.py in this device copy), then again
#            with its LINRNN_GDN_BF16_WIDE=1 flag at B = 64, 128, 256
#   tests    pytest -k "gpu_decode or partition_major" (compiled kernel vs the naive reference at 35B-A3B shapes;
#            partition-major == natural order bit for bit)
#   check    tools/gdn_bf16_check.py on $CONFIGS: vs the naive reference (NaN-poisoned unused slots) and vs the
#            old kernel bit for bit, 0 / 50 / 100 % f32 heads, B = 1, 8, 64, 256
#   sweep    linrnn_bench.kernels.gdn_decode_probe: old kernel and the $SWEEP variants side by side at 0 / 50 %
#            f32 heads, B = 32, 64, 128, 256 (two interleaved passes, a size-matched copy per row)
# Prints the tables; everything lands under $OUT/bf16.
#   bash tools/gpu_gdn_bf16.sh [same,new,engine,old,tests]
. tools/device_env.sh >/dev/null
STAGES=${1:-same,new,engine,old,tests}
R=${OUT:-/tmp/out}/bf16
mkdir -p $R
has() { [[ ",$STAGES," == *",$1,"* ]]; }
[ -f kernels/gdn/decode_main.py ] || cp benchmarks/results/kernels/gdn-decode/bf16_round/variants/decode_before.py.txt \
  kernels/gdn/decode_main.py
EF=evict_first
CONFIGS=${CONFIGS:-"[None, (64, 4, '$EF', '$EF', 128, None, 4, 3), (64, 4, '$EF', '$EF', 128, None, 3, 4)]"}
SWEEP=${SWEEP:-"[('decode_main', (64, 4, '$EF', '$EF')), ('decode', (64, 4, '$EF', '$EF', 128, None, 4, 3)),
  ('decode', (64, 4, '$EF', '$EF', 128, None, 3, 4)), ('decode', (64, 4, '$EF', '$EF', 128, None, 2, 4)),
  ('decode', (64, 4, '$EF', '$EF', None, None, 3, 3)), ('decode', (64, 4, '$EF', '$EF', 128, None, 4, 2))]"}
GDN="python3 -m linrnn_bench.kernels.gdn --prefill '' --no-peer --hybrid 0.5 --batches 1,8,32,64,128,256"
if has same; then
  timeout 40 python3 - <<'PY' 2>&1 | grep -vE "Warning|warn" | tee $R/same.log
import torch
from linrnn_bench.kernels.gdn import head_mask, make_pools, make_step_inputs
from linrnn_kernels.gdn import decode, decode_main
for f in (1.0, 0.5, 0.0):
    for B in (1, 8, 64, 256):
        q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, seed=B)
        f32, bf, isb, loc = make_pools(head_mask(f, seed=B), B + 1)
        idx = torch.randperm(B, device="cuda").to(torch.int32) + 1
        f0, b0 = f32.clone(), bf.clone()
        o_old = decode_main.gdn_decode(q, k, v, a, b, A_log, dt_bias, f0, b0, isb, loc, idx)
        o_new = decode.gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx)
        same = (torch.equal(o_old.view(torch.int16), o_new.view(torch.int16))
                and torch.equal(f0.view(torch.int32), f32.view(torch.int32))
                and torch.equal(b0.view(torch.int16), bf.view(torch.int16)))
        print(f"{'ok' if same else 'FAIL'} f32 heads {f:.0%} B={B}: new == old bit for bit: {same}", flush=True)
PY
fi
if has check; then
  timeout 90 python3 tools/gdn_bf16_check.py --configs "$CONFIGS" 2>&1 | grep -vE "Warning|warn" | tee $R/check.log \
    | grep -E "FAIL|Error|Traceback|False" | head -20
  echo "check: $(grep -c '^ok' $R/check.log) ok, $(grep -c '^FAIL' $R/check.log) FAIL, $(grep -c 'bit: True' $R/check.log) bit-identical to old"
fi
if has sweep; then
  timeout ${SWEEP_S:-200} python3 -m linrnn_bench.kernels.gdn_decode_probe --batches ${SWEEP_B:-128,64,256,32} \
    --fractions 0.0,0.5 --variants "$SWEEP" --out $R/sweep 2>&1 | grep -vE "Warning|warn" | tee $R/sweep.log
fi
if has new; then
  eval timeout 50 $GDN --out $R/new 2>&1 | grep -vE "Warning|warn" | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" | tee $R/new.log
fi
if has engine; then
  timeout 110 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 64,128 \
    --config 'model=qwen35moe-nvfp4,label=nvfp4 f32' --config 'model=qwen35moe-nvfp4,ssm-bf16-tau=16,label=nvfp4 tau=16' \
    --no-progress --out $R/batched 2>&1 | grep -vE "Warning|warn" | tee $R/batched.log | tail -12
fi
if has old; then
  cp kernels/gdn/decode.py /tmp/decode_new.py && cp kernels/gdn/decode_main.py kernels/gdn/decode.py
  eval timeout 45 $GDN --out $R/old 2>&1 | grep -vE "Warning|warn" | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" | tee $R/old.log
  # the old kernel's never-measured flag: bf16 heads on one [Dk, 2 bv] tile (8 bf16 per access)
  export LINRNN_GDN_BF16_WIDE=1
  eval timeout 30 $GDN --batches 64,128,256 --out $R/old_wide 2>&1 | grep -vE "Warning|warn" \
    | grep -E "^\| [0-9]|copy bandwidth|FAIL|Error" | tee $R/old_wide.log
  unset LINRNN_GDN_BF16_WIDE
  cp /tmp/decode_new.py kernels/gdn/decode.py
fi
rm -f kernels/gdn/decode_main.py
if has tests; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_kernels.py -k "gpu_decode or partition_major" -n 4 2>&1 | tail -3 \
    | tee $R/tests.log
fi
