#!/usr/bin/env bash
# #15 H3: the fused router at 1-8 rows. Device calls (repo root as cwd; the tree as it came is main, .gpu/$BR the
# branch's overlay; every stage under `timeout`):
#   bash tools/gpu_router.sh sweep   the overlay: tools/gpu_router.py --set sweep (the router alone at M = 1, 2, 4, 8,
#                                    PDL off: the table's tile config with every RouterTail variant, other tiles with
#                                    the new tails, the tail alone at 1 / 4 / 8 warps) -> $OUT/router/sweep/;
#                                    then the router's GPU tests at 35B shapes
#   bash tools/gpu_router.sh prep [COMMIT]   (workstation) the router's files of COMMIT (default d3e2d8e, main before
#                                    round 6) into .gpu/router_before/, for `ab` after the merge
#   bash tools/gpu_router.sh ab      the "before" (.gpu/router_before overlaid, else the tree as it came with the branch
#                                    in .gpu/$BR for the "after"): tools/gpu_router.py --set final (the router alone,
#                                    PDL off) and bench batched npl 1,8 (PDL on); then the "after": the router alone
#                                    (the new default, the plain tail, other tiles at 4 / 8 rows; table.json = tuned.json
#                                    with a router tile replaced where another beat it by >= 0.5 us) and bench batched
#                                    npl 1,8 (PDL on, with that table) with the profile at npl 1 and 8 -> $OUT/router/
#                                    Lead, after the merge: `bash tools/gpu_router.sh prep` here, then a device call
#                                    (timeout ~450 s, carry [".whl", ".gpu/router_before"]):
#                                    `bash tools/gpu_router.sh ab`
R=${OUT:-/tmp/out}/router; mkdir -p $R
BR=${BR:-small-decode}
B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8 --no-progress"
row() { grep -E "\| 128 \| 128 \||^profile:|launches|Error" "$@" | cut -c1-170 | head -8; }
TESTS="tests/test_gemv_kernels.py -k router"
case "$1" in
prep) ;;
*) . tools/device_env.sh >/dev/null ;;
esac
case "$1" in
sweep)
  cp -r .gpu/$BR/. ./
  timeout 170 python3 tools/gpu_router.py --set sweep --out $R/sweep > $R/sweep.log 2>&1
  grep -E "^M=|compiled|COMPILE|Error" $R/sweep.log | cut -c1-200
  timeout 50 python3 -m pytest -m gpu $TESTS -q -p no:cacheprovider -rfE > $R/tests.log 2>&1; tail -1 $R/tests.log
  grep -E "FAILED|ERROR" $R/tests.log | head -5
  ;;
prep)
  # on the workstation, before a device call: the router's files as of commit $2 (default: main before round 6,
  # d3e2d8e) into .gpu/router_before/ (git-ignored); the call then passes carry [".whl", ".gpu/router_before"]
  C=${2:-d3e2d8e}; D=.gpu/router_before; rm -rf $D
  for f in kernels/moe/router_fused.py kernels/moe/router.py kernels/gemv/config.py kernels/gemv/tuned.json; do
    mkdir -p $D/$(dirname $f); git show $C:$f > $D/$f
  done; echo "$D <- $C"
  ;;
ab)
  # the "before" (.gpu/router_before: the router's files of an older commit, `prep`; else the tree as it came, the
  # branch then in .gpu/$BR) first: the router alone with this tool, then bench batched; then the tree as it came (or
  # the overlay): the router alone (--pick-table) and bench batched with the profile. ~400 s from a cold machine
  # (the first engine build compiles every kernel: ~75 s of it)
  T=/tmp/rt; mkdir -p $T/cur
  if [ -d .gpu/router_before ]; then
    (cd .gpu/router_before && find . -type f) | while read f; do cp --parents "$f" $T/cur/; done
    cp -r .gpu/router_before/. ./
  fi
  timeout 60 python3 tools/gpu_router.py --set final --out $R/final_before > $R/final_before.log 2>&1
  grep -E "^M=|compiled|COMPILE|Error" $R/final_before.log | cut -c1-200
  timeout 160 $B --config 'model=qwen35moe-nvfp4,label=before' --out $T/before > $R/before.log 2>&1; row $R/before.log
  cp $T/before/batched.md $R/before.md
  if [ -d .gpu/router_before ]; then cp -r $T/cur/. ./; else cp -r .gpu/$BR/. ./; fi
  timeout 60 python3 tools/gpu_router.py --set final --out $R/final --pick-table $R/table.json > $R/final.log 2>&1
  grep -E "^M=|compiled|COMPILE|PICK|Error" $R/final.log | cut -c1-200
  [ -s $R/table.json ] && export LINRNN_SKINNY_TABLE=$R/table.json
  timeout 110 $B --profile 1,8 --profile-top 40 --config "model=qwen35moe-nvfp4,label=after" --out $T/after \
    > $R/after.log 2>&1; row $R/after.log; cp $T/after/batched.md $R/after.md
  grep -E "_router_kernel|launches" $R/after.md | cut -c1-170 | head -6
  ;;
esac
