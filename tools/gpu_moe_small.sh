#!/usr/bin/env bash
# NVFP4 MoE small batches, round 6 (issue #13 item 3): the launch chain around the MMA GEMMs. New against round 5:
# gate_up launched with PDL behind the router (experts.PDL_GATE_UP), route_align_logits, route() and the one-launch
# alignment under PDL (router.ROUTE_PDL). (Call 1 at 923fd21 also ran the down kernel's fused combine, since removed.)
# Device calls on one H200 (timeout_s <= 240; every stage under `timeout`; LINRNN_COMMIT=<sha>; the branch overlaid:
# cp -r .gpu/moe-small/. ./ first):
#   bash tools/gpu_moe_small.sh layer   1. tests/test_nvfp4_mma.py GPU cases (PDL bitwise tests), the router / align
#                                          GPU tests
#                                       2. the `moe` layer benchmark B = 1 .. 256: nvfp4/mma (new) and nvfp4/mma-r5 (round
#                                          5's chain) in one run with the copy bandwidth; MMA candidates (round 5 chain,
#                                          each change alone, 2 / 4 units per step at register budget 128); profile
#   bash tools/gpu_moe_small.sh engine  the layer benchmark (new vs r5; new again behind a reading L2 flush), bench batched
#                                       --npl 1,8 (35B-A3B NVFP4 dummy, f32 state): new, then round 5's chain
#                                       (LINRNN_MMA_PDL_GATE_UP=0 LINRNN_ROUTE_PDL=0); the engine's graphs-on ==
#                                       graphs-off test; the router / align GPU tests
#   bash tools/gpu_moe_small.sh batched bench batched --npl 1,8 new, then round 5's chain (about 200 s on a cold machine)
#   bash tools/gpu_moe_small.sh flush   the layer (nvfp4/mma) behind do_bench's zeroing L2 flush, then a reading one
# Results under $OUT/moe_small (*.log, moe*/, batched_*/).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/moe_small
mkdir -p $R
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
quiet() { grep -vE "leaked|nanobind|^ - |Warning|warn|^\{|^profile |^mma sweep"; }
MOE="python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma,nvfp4/mma-r5 --sets 3 --rep ${REP:-100} --profile"
BB="python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg ${NTG:-64} --npl 1,8 --no-progress"
R5="LINRNN_MMA_PDL_GATE_UP=0 LINRNN_ROUTE_PDL=0"
ENGINE_TESTS=("tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]")
layer_table() {  # the layer rows (us, GB/s, % copy per variant) and the candidates' table
  quiet < $1 | grep -E "^copy bandwidth|^\| B \||^\| [0-9]+ \| [0-9]+ \|" | head -9
  grep -A9 "layer time per variant" $2/moe_*.md | tail -8
}
echo "commit ${LINRNN_COMMIT:-?}"
case "$1" in
layer)
  timeout ${T_TESTS:-100} python3 -m pytest -q -n 4 -m gpu tests/test_nvfp4_mma.py -p no:cacheprovider -rfE \
    --junitxml=$R/test_nvfp4_mma_gpu.xml > $R/tests.log 2>&1; el tests; tail -1 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head -5
  timeout ${T_ROUTER:-40} python3 -m pytest -q -n 2 -m gpu tests/test_gemv_kernels.py tests/test_moe_kernels.py -k "route or router or align" \
    -p no:cacheprovider -rfE --junitxml=$R/test_router_align_gpu.xml > $R/router.log 2>&1; el router; tail -1 $R/router.log
  grep -E "^(FAILED|ERROR)" $R/router.log | head -5
  timeout ${T_BENCH:-90} $MOE --mma-sweep --mma-candidates "${CANDIDATES:-default,round 5 chain,gate_up plain,route and align plain,2 units budget 128,4 units budget 128}" \
    --out $R/moe > $R/moe.log 2>&1; el moe
  layer_table $R/moe.log $R/moe
  ;;
engine)
  timeout ${T_BENCH:-40} $MOE --out $R/moe2 > $R/moe2.log 2>&1; el moe
  layer_table $R/moe2.log $R/moe2
  # the same layer timed behind an L2 flush that leaves clean lines (reads 256 MB) instead of do_bench's zeroing (dirty
  # lines written back during the timed kernels): how much of the layer's time between kernels is that write-back
  timeout ${T_FLUSH:-30} python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma --sets 3 --rep 60 --flush read \
    --out $R/moe_read > $R/moe_read.log 2>&1; el flush; layer_table $R/moe_read.log $R/moe_read
  timeout ${T_NEW:-65} $BB --out $R/batched_new > $R/batched_new.log 2>&1; el new
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_new/batched.md | cut -d"|" -f4,11
  env $R5 timeout ${T_OLD:-35} $BB --out $R/batched_old > $R/batched_old.log 2>&1; el old
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_old/batched.md | cut -d"|" -f4,11
  timeout ${T_ENGINE:-45} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --junitxml=$R/test_engine_graphs_gpu.xml \
    "${ENGINE_TESTS[@]}" > $R/engine.log 2>&1; el engine; tail -1 $R/engine.log
  timeout ${T_ROUTER:-25} python3 -m pytest -q -n 4 -m gpu tests/test_gemv_kernels.py tests/test_moe_kernels.py -k "route or router or align" \
    -p no:cacheprovider -rfE --junitxml=$R/test_router_align_gpu.xml > $R/router.log 2>&1; el router; tail -1 $R/router.log
  ;;
batched)  # the engine old vs new alone (call 2's engine stage timed out on a cold machine: 65 s were too few)
  timeout ${T_NEW:-140} $BB --out $R/batched_new > $R/batched_new.log 2>&1; el new
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_new/batched.md | cut -d"|" -f4,11
  env $R5 timeout ${T_OLD:-90} $BB --out $R/batched_old > $R/batched_old.log 2>&1; el old
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_old/batched.md | cut -d"|" -f4,11
  ;;
flush)  # the layer (new) behind do_bench's zeroing L2 flush and behind a reading one, one after the other
  for F in zero read; do
    timeout ${T_FLUSH:-70} python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma --sets 3 --rep 60 --flush $F \
      --out $R/moe_$F > $R/moe_$F.log 2>&1; el $F; layer_table $R/moe_$F.log $R/moe_$F
  done
  ;;
*) echo "usage: $0 layer|engine|batched|flush"; exit 2 ;;
esac
