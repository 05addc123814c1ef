#!/usr/bin/env bash
# #15 H1 (round 5): the K = 4096 out projections at M = 1..8 with one-shot skinny tiles (kernels/gemv/skinny.py
# ONE_SHOT: a program's whole weight slice loaded before the PDL wait). Device calls (repo root as cwd; every
# stage under `timeout`; the tree as it came is main, .gpu/$BR the branch's overlay):
#   bash tools/gpu_gemv_r5.sh sweep   the overlay: gemv benchmark of the one-shot tiles (plus the table's current
#                                     config) for gdn.out_proj / attn.o_proj at M = 1, 2, 4, 8 and shared.down at
#                                     M = 1, 8 -> $OUT/r5/sweep*/ (gemv.md, skinny_table.json = tuned.json updated);
#                                     diagnostic: the same GEMV without fusions (diag.out_proj_plain) at M = 1, 8
. tools/device_env.sh >/dev/null
R=${OUT:-/tmp/out}/r5; mkdir -p $R
BR=${BR:-small-decode}
G="python3 -m linrnn_bench.kernels.gemv --one-shot-only --workers 16"
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
esac
