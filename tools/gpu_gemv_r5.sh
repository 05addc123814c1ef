#!/usr/bin/env bash
# #15 H1 (round 5): the K = 4096 out projections at M = 1..8 with one-shot skinny tiles (kernels/gemv/skinny.py
# ONE_SHOT: a program's whole weight slice loaded before the PDL wait). Device calls (repo root as cwd; every
# stage under `timeout`; the tree as it came is main, .gpu/$BR the branch's overlay):
#   bash tools/gpu_gemv_r5.sh sweep   the overlay: gemv benchmark of the one-shot tiles (plus the table's current
#                                     config) for gdn.out_proj / attn.o_proj at M = 1, 2, 4, 8 and shared.down at
#                                     M = 1, 8 -> $OUT/r5/sweep*/ (gemv.md, skinny_table.json = tuned.json updated);
#                                     diagnostic: the same GEMV without fusions (diag.out_proj_plain) at M = 1, 8
#   bash tools/gpu_gemv_r5.sh sweep2  the overlay: the out projections at M = 1, 4, 8 with the one-shot tiles and the
#                                     split prologue (the gated norm / sigmoid gate in its own launch) -> $OUT/r5/sweep2/;
#                                     then bench batched npl 1,8 (PDL on): main's tree (first) vs the overlay
#   bash tools/gpu_gemv_r5.sh ab      main's tree: bench batched npl 1,8 (PDL on, the default; with AB_MAIN_PROFILE=1
#                                     also LINRNN_PDL=0 with the per-kernel profile at npl 1 and 8); then the overlay: the out-projection GPU
#                                     tests (35B shapes vs naive, run to run and graph replay == eager), bench batched
#                                     npl 1,8 (PDL on) and the PDL-off profile; last the fusions' costs at M = 1, 8
#                                     (diag.out_proj_plain / _res / _res_norm) -> $OUT/r5/
. tools/device_env.sh >/dev/null
R=${OUT:-/tmp/out}/r5; mkdir -p $R
BR=${BR:-small-decode}
G="python3 -m linrnn_bench.kernels.gemv --one-shot-only --workers 16"
B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8 --no-progress"
row() { grep -E "\| 128 \| 128 \||^profile:|Error" "$@" | cut -c1-160 | head -6; }
KERN="skinny|prologue|add_rmsnorm|gated_rmsnorm|nvjet|splitK|sigmoid|elementwise"
case "$1" in
sweep)
  cp -r .gpu/$BR/. ./
  timeout 300 $G --only gdn.out_proj,attn.o_proj --m 1,2,4,8 --base-table kernels/gemv/tuned.json --out $R/sweep \
    > $R/sweep.log 2>&1; grep -E "^(gdn|attn)|precompiled|Error" $R/sweep.log | cut -c1-200 | head -20
  timeout 70 $G --only shared.down --m 1,8 --base-table $R/sweep/skinny_table.json --out $R/sweep_down \
    > $R/sweep_down.log 2>&1; grep -E "^shared|precompiled|Error" $R/sweep_down.log | cut -c1-200 | head -6
  timeout 60 $G --only diag.out_proj_plain --m 1,8 --out $R/sweep_plain > $R/sweep_plain.log 2>&1
  grep -E "^diag|precompiled|Error" $R/sweep_plain.log | cut -c1-200 | head -6
  ;;
sweep2)
  timeout 90 $B --config 'model=qwen35moe-nvfp4,label=main' --out $R/main2 > $R/main2.log 2>&1; row $R/main2/batched.md $R/main2.log
  cp -r .gpu/$BR/. ./
  timeout 200 $G --only gdn.out_proj,attn.o_proj --m 1,4,8 --base-table kernels/gemv/tuned.json --out $R/sweep2 \
    > $R/sweep2.log 2>&1; grep -E "^(gdn|attn)|precompiled|Error" $R/sweep2.log | cut -c1-200 | head -20
  timeout 90 $B --config "model=qwen35moe-nvfp4,label=$BR" --out $R/new2 > $R/new2.log 2>&1; row $R/new2/batched.md $R/new2.log
  ;;
ab)
  # main's tree first (the "before"), PDL on then the PDL-off profile; then the overlay (the "after"). A call returns
  # at most 8 files: logs and the profiled runs' batched.md under $R, everything else under /tmp/r5
  T=/tmp/r5; mkdir -p $T
  timeout 90 $B --config 'model=qwen35moe-nvfp4,label=main' --out $T/main > $R/main.log 2>&1; row $R/main.log
  if [ -n "$AB_MAIN_PROFILE" ]; then  # main's PDL-off profile too (~40 s more)
    LINRNN_PDL=0 timeout 75 $B --profile 1,8 --profile-top 40 --config 'model=qwen35moe-nvfp4,label=main LINRNN_PDL=0' \
      --out $T/main_pdl0 > $R/main_pdl0.log 2>&1; row $R/main_pdl0.log; cp $T/main_pdl0/batched.md $R/main_pdl0.md
  fi
  cp -r .gpu/$BR/. ./
  timeout 75 python3 -m pytest -m gpu tests/test_gemv_kernels.py -k "out_projections or graph or full_shapes" -q \
    -p no:cacheprovider -rfE > $R/tests.log 2>&1; tail -1 $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head -5
  timeout 75 $B --config "model=qwen35moe-nvfp4,label=$BR" --out $T/new > $R/new.log 2>&1; row $R/new.log
  LINRNN_PDL=0 timeout 75 $B --profile 1,8 --profile-top 40 --config "model=qwen35moe-nvfp4,label=$BR LINRNN_PDL=0" \
    --out $T/new_pdl0 > $R/new_pdl0.log 2>&1; row $R/new_pdl0.log; cp $T/new_pdl0/batched.md $R/new_pdl0.md
  grep -E "$KERN" $R/new_pdl0.md | cut -c1-140 | head -20
  timeout 60 $G --only diag.out_proj_plain,diag.out_proj_res,diag.out_proj_res_norm --m 1,8 --out $T/diag \
    > $R/diag.log 2>&1; grep -E "^diag|precompiled|Error" $R/diag.log | cut -c1-200 | head -8
  ;;
esac
