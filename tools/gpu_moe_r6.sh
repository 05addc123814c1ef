#!/usr/bin/env bash
# NVFP4 MoE decode layer round 6 (issue #13, H3): the adaptive 16-token tile (experts.MMA_ADAPTIVE_16: 16-token expert
# blocks with <= 8 tokens run the 8-token K loop in the same launch) and two 16-row tiles per warp (mrep: one activation
# load feeds both tiles' MMAs).
# Device calls on one H200 (timeout_s <= 240; every stage under `timeout`; LINRNN_COMMIT=<sha>; the branch overlaid:
# cp -r .gpu/<branch>/. ./ first):
#   bash tools/gpu_moe_r6.sh layer    1. tests/test_nvfp4_mma.py GPU cases (test_mma_tiles_bitwise_equal with the adaptive
#                                        tile, test_mma_per_expert_loads 0/1/7/8/9/15/16/17, test_mma_adaptive_pair_blocks_16)
#                                        and the two-row-tiles-per-warp / 8-warp tiles bitwise against the default)
#                                     2. the `moe` layer benchmark B = 1 .. 256 (BS), nvfp4/mma and nvfp4/asm (the old kernel;
#                                        OLD=0 leaves it out) with copy bandwidth in the same run, candidates (CANDIDATES:
#                                        default, the B = 8-128 tile at every batch, two 16-row tiles per warp at the
#                                        default tile / 1 unit / 8-token blocks), per-kernel profile
#                                     VARIANTS (default nvfp4/mma,nvfp4/asm), MOE_ARGS (e.g. "--flush read") pass through, TESTS=0 skips stage 1
# Results under $OUT/moe_r6 (*.log, *.xml, moe/).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/moe_r6
mkdir -p $R
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
quiet() { grep -vE "leaked|nanobind|^ - |Warning|warn|^\{|^profile |^mma sweep"; }
VARIANTS=${VARIANTS:-nvfp4/mma,nvfp4/asm}; [ "${OLD:-1}" = 0 ] && VARIANTS=nvfp4/mma
MOE="python3 -m linrnn_bench.kernels.moe --variants $VARIANTS --sets 3 --rep ${REP:-100} --profile --mma-sweep --batch-sizes ${BS:-1,8,32,64,128,256} ${MOE_ARGS:-}"
echo "commit ${LINRNN_COMMIT:-?}"
case "$1" in
layer)
  [ "${TESTS:-1}" = 1 ] && timeout ${T_TESTS:-90} python3 -m pytest -q -n ${NPROC:-4} -m gpu tests/test_nvfp4_mma.py -p no:cacheprovider -rfE \
    --junitxml=$R/test_nvfp4_mma_gpu.xml > $R/tests.log 2>&1 && el tests; tail -1 $R/tests.log 2>/dev/null; grep -E "^(FAILED|ERROR)" $R/tests.log 2>/dev/null | head -5
  timeout ${T_BENCH:-130} $MOE --mma-candidates "${CANDIDATES:-default,8-token blocks 2 units,2 row tiles per warp,2 row tiles per warp 1 unit,2 row tiles per warp 8-token blocks}" \
    --out $R/moe > $R/moe.log 2>&1; el moe
  quiet < $R/moe.log | grep -E "^\| [0-9]+ \| [0-9]+ \| |^- B=(1|64|128|256) " | head -14
  grep -A9 "layer time per variant" $R/moe/moe_*.md | tail -7
  ;;
*) echo "usage: $0 layer"; exit 2 ;;
esac
