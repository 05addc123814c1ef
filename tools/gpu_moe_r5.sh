#!/usr/bin/env bash
# NVFP4 MoE decode layer round 5 (issue #13): programmatic dependent launch through gate_up -> down -> combine
# (nvfp4_mma.DEFAULT_PDL; the down kernel loads its expert ids and first weights before its grid dependency wait).
# Device calls on one H200 (timeout_s <= 280; every stage under `timeout`; LINRNN_COMMIT=<sha>; the branch overlaid:
# cp -r .gpu/<branch>/. ./ first):
#   bash tools/gpu_moe_r5.sh layer    1. tests/test_nvfp4_mma.py GPU cases (test_mma_pdl_bitwise_equal: PDL on == off bit
#                                        for bit, eager and graph replays, B = 1 / 8 / 64 / 256)
#                                     2. the `moe` layer benchmark B = 1 .. 256 (default = PDL on), candidates PDL off (=
#                                        main's launches), 2 units budget 64 with and without PDL, per-kernel profile
#                                     3. the engine's graphs-on == graphs-off greedy test on NVFP4 A3B-shaped models
#   bash tools/gpu_moe_r5.sh engine   the layer benchmark (default, PDL off, 2 units budget 72; profile with PDL off), then
#                                     bench batched --npl 1,8,128 (35B-A3B NVFP4 dummy, f32 state): PDL chain on (default,
#                                     profile at npl 1), then off (LINRNN_MMA_PDL=0, main's launches); the engine test
# Results under $OUT/moe_r5 (*.log, moe_*/, batched_*/).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/moe_r5
mkdir -p $R
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
quiet() { grep -vE "leaked|nanobind|^ - |Warning|warn|^\{|^profile |^mma sweep"; }
MOE="python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma --sets 3 --rep ${REP:-100} --profile --mma-sweep"
BB="python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg ${NTG:-64} --npl 1,8,128 --no-progress"
ENGINE_TESTS=("tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]")
echo "commit ${LINRNN_COMMIT:-?}"
case "$1" in
layer)
  timeout ${T_TESTS:-110} python3 -m pytest -q -n 4 -m gpu tests/test_nvfp4_mma.py -p no:cacheprovider -rfE \
    --junitxml=$R/test_nvfp4_mma_gpu.xml > $R/tests.log 2>&1; el tests; tail -1 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head -5
  timeout ${T_BENCH:-90} $MOE --mma-candidates "${CANDIDATES:-default,PDL off,2 units budget 64,PDL on 2 units budget 64}" \
    --out $R/moe > $R/moe.log 2>&1; el moe
  quiet < $R/moe.log | grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \| [0-9]+ %|^- B=(1|64|256) " | head -12
  grep -A9 "layer time per variant" $R/moe/moe_*.md | tail -7
  timeout ${T_ENGINE:-60} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --junitxml=$R/test_engine_graphs_gpu.xml \
    "${ENGINE_TESTS[@]}" > $R/engine.log 2>&1; el engine; tail -1 $R/engine.log
  ;;
engine)
  # the layer first: default (PDL on), PDL off (= main's launches), a 16-token tile at B = 256; profile with PDL off
  timeout ${T_BENCH:-80} $MOE --mma-candidates "${CANDIDATES:-default,PDL off,2 units budget 72}" --out $R/moe2 > $R/moe2.log 2>&1; el moe
  quiet < $R/moe2.log | grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \| [0-9]+ %|^- B=(1|64|256) " | head -12
  grep -A9 "layer time per variant" $R/moe2/moe_*.md | tail -7
  timeout ${T_NEW:-80} $BB --profile 1 --profile-top 30 --out $R/batched_new > $R/batched_new.log 2>&1; el new
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_new/batched.md | cut -d"|" -f4,11; grep -E "nvfp4_mma" $R/batched_new/batched.md | head -2 | cut -c1-160
  LINRNN_MMA_PDL=0 timeout ${T_OLD:-70} $BB --out $R/batched_old > $R/batched_old.log 2>&1; el old
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_old/batched.md | cut -d"|" -f4,11
  timeout ${T_ENGINE:-100} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --junitxml=$R/test_engine_graphs_gpu.xml \
    "${ENGINE_TESTS[@]}" > $R/engine.log 2>&1; el engine; tail -1 $R/engine.log
  ;;
*) echo "usage: $0 layer|engine"; exit 2 ;;
esac
