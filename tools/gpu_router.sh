#!/usr/bin/env bash
# #15 H3: the fused router at 1-8 rows. Device calls (repo root as cwd; the tree as it came is main, .gpu/$BR the
# branch's overlay; every stage under `timeout`):
#   bash tools/gpu_router.sh sweep   the overlay: tools/gpu_router.py --set sweep (the router alone at M = 1, 2, 4, 8,
#                                    PDL off: the table's tile config with every RouterTail variant, other tiles with
#                                    the new tails, the tail alone at 1 / 4 / 8 warps) -> $OUT/router/sweep/;
#                                    then the router's GPU tests at 35B shapes
#   bash tools/gpu_router.sh ab      main's tree: tools/gpu_router.py --set final (main's router alone, PDL off) and
#                                    bench batched npl 1,8 (PDL on); then the overlay:
#                                    tools/gpu_router.py --set final (the router alone, PDL off: the new default, the
#                                    plain tail = main's kernel at 2-8 rows, other tiles at 4 / 8 rows; table.json =
#                                    tuned.json with a router tile replaced where another beat it by >= 0.5 us), then
#                                    bench batched npl 1,8 (PDL on, with that table) with the profile at npl 1 and 8
#                                    (launches per step, kernel table) -> $OUT/router/
. tools/device_env.sh >/dev/null
R=${OUT:-/tmp/out}/router; mkdir -p $R
BR=${BR:-small-decode}
B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8 --no-progress"
row() { grep -E "\| 128 \| 128 \||^profile:|launches|Error" "$@" | cut -c1-170 | head -8; }
TESTS="tests/test_gemv_kernels.py -k router"
case "$1" in
sweep)
  cp -r .gpu/$BR/. ./
  timeout 170 python3 tools/gpu_router.py --set sweep --out $R/sweep > $R/sweep.log 2>&1
  grep -E "^M=|compiled|COMPILE|Error" $R/sweep.log | cut -c1-200
  timeout 50 python3 -m pytest -m gpu $TESTS -q -p no:cacheprovider -rfE > $R/tests.log 2>&1; tail -1 $R/tests.log
  grep -E "FAILED|ERROR" $R/tests.log | head -5
  ;;
ab)
  # main's tree first (the "before": the router alone with this tool, then bench batched), then the overlay (the
  # "after"); ~400 s in all from a cold machine (main's first engine build compiles every kernel: ~75 s of it)
  T=/tmp/rt; mkdir -p $T
  cp .gpu/$BR/tools/gpu_router.py tools/
  timeout 60 python3 tools/gpu_router.py --set final --out $R/final_main > $R/final_main.log 2>&1
  grep -E "^M=|compiled|COMPILE|Error" $R/final_main.log | cut -c1-200
  timeout 160 $B --config 'model=qwen35moe-nvfp4,label=main' --out $T/main > $R/main.log 2>&1; row $R/main.log
  cp $T/main/batched.md $R/main.md
  cp -r .gpu/$BR/. ./
  timeout 60 python3 tools/gpu_router.py --set final --out $R/final --pick-table $R/table.json > $R/final.log 2>&1
  grep -E "^M=|compiled|COMPILE|PICK|Error" $R/final.log | cut -c1-200
  [ -s $R/table.json ] && export LINRNN_SKINNY_TABLE=$R/table.json
  timeout 110 $B --profile 1,8 --profile-top 40 --config "model=qwen35moe-nvfp4,label=$BR" --out $T/new \
    > $R/new.log 2>&1; row $R/new.log; cp $T/new/batched.md $R/new.md
  grep -E "_router_kernel|launches" $R/new.md | cut -c1-170 | head -6
  ;;
esac
