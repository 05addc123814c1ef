#!/usr/bin/env bash
# NVFP4 MMA kernel round 4 (issues #13 / #15): the tile per batch (64-k units per K step and ptxas's register
# budget, kernels/moe/experts.MMA_TILES) and round 3's B = 1 regression (ptxas sinks the K loop's loads at 44
# registers). Device calls on one H200 (timeout_s 240; every stage under `timeout`; LINRNN_COMMIT=<sha>):
#   bash tools/gpu_mma_r4.sh sweep   this tree (the branch overlaid: cp -r .gpu/<branch>/. ./ first):
#       1. tests/test_nvfp4_mma.py GPU cases (incl. test_mma_tiles_bitwise_equal: 1 / 2 / 4 units, with and
#          without the register budget, 8 / 16 tokens, bit for bit; equality with `naive` at the table's tiles)
#       2. the `moe` layer benchmark, B = 1 .. 256: the table's tile (default), round 3's tile and the units x
#          register budget variants (MMA_CANDIDATES), per-kernel profile of the default
#       3. the engine's graphs-on == graphs-off greedy test on NVFP4 A3B-shaped models (B = 1, 64)
#   bash tools/gpu_mma_r4.sh ab      the branch overlay .gpu/$BR (new) and round 3's experts.py / nvfp4_mma.py in .gpu/$BR-old
#                                    (carry both):
#       1. (new) the engine's graphs-on == graphs-off greedy test on NVFP4 A3B-shaped models (B = 1, 64)
#       2. (new) the layer benchmark B = 1 .. 256 with round 3's tile as a candidate (the old tree's kernel: the
#          same code, launched without a register budget at 1 unit per step) and budget / split variants
#       3. bench batched --npl 1,8,128 (35B-A3B NVFP4 dummy, f32 state): new with the profile at npl 1, then old
#          (.gpu/$BR-old's files put back)
#   bash tools/gpu_mma_r4.sh engine  the engine test of 1. / 3. above alone (timeout_s >= 240; on main as merged)
# Results under $OUT/mma_r4 (*.log, batched_*/, moe_*/).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/mma_r4
mkdir -p $R
BR=${BR:-moe-prefill}
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
quiet() { grep -vE "leaked|nanobind|^ - |Warning|warn|^\{|^profile |^mma sweep"; }
MOE="python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma --sets 3 --rep ${REP:-100} --profile --mma-sweep"
BB="python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg ${NTG:-64} --npl 1,8,128 --no-progress"
case "$1" in
sweep)
  timeout ${T_TESTS:-90} python3 -m pytest -q -n 4 -m gpu tests/test_nvfp4_mma.py -p no:cacheprovider -rfE \
    --junitxml=$R/test_nvfp4_mma_gpu.xml > $R/tests.log 2>&1; el tests; tail -1 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head -5
  timeout ${T_BENCH:-80} $MOE --mma-candidates "${CANDIDATES:-default,round 3 tile (1 unit without budget),1 unit budget 64,1 unit budget 80,2 units per step,2 units budget 64,2 units budget 80,budget 80 split to 1/SM,budget 80 split to 4/SM}" \
    --out $R/moe_sweep > $R/moe_sweep.log 2>&1; el moe; quiet < $R/moe_sweep.log | tail -32
  timeout ${T_ENGINE:-60} python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml=$R/test_engine_graphs_gpu.xml \
    "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]" \
    > $R/engine.log 2>&1; el engine; tail -1 $R/engine.log
  ;;
ab)
  # the old kernel files (round 3: experts.py, nvfp4_mma.py) carried in .gpu/$BR-old/kernels/moe/; new first, old last
  test -f .gpu/$BR-old/kernels/moe/nvfp4_mma.py || { echo "no old files in .gpu/$BR-old"; exit 2; }
  cp -r .gpu/$BR/. ./
  timeout ${T_ENGINE:-60} python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml=$R/test_engine_graphs_gpu.xml \
    "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]" \
    > $R/engine.log 2>&1; el engine; tail -1 $R/engine.log
  timeout ${T_BENCH:-45} $MOE --mma-candidates "${CANDIDATES:-default,round 3 tile (1 unit without budget),budget 80 split to 1/SM,2 units budget 64}" \
    --out $R/moe_ab > $R/moe_ab.log 2>&1; el moe; quiet < $R/moe_ab.log | grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \| [0-9]+ %|^- B=1 " | head -8
  grep -A9 "layer time per variant" $R/moe_ab/moe_*.md | tail -7
  timeout ${T_NEW:-70} $BB --profile 1 --profile-top 30 --out $R/batched_new > $R/batched_new.log 2>&1; el new
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_new/batched.md | cut -d"|" -f4,11; grep -E "nvfp4_mma" $R/batched_new/batched.md | head -2 | cut -c1-160
  cp .gpu/$BR-old/kernels/moe/*.py kernels/moe/
  timeout ${T_OLD:-60} $BB --out $R/batched_old > $R/batched_old.log 2>&1; el old
  grep -E "^\| 128 \| [0-9]+ \| " $R/batched_old/batched.md | cut -d"|" -f4,11
  ;;
engine)
  # the engine's graphs-on == graphs-off greedy test on NVFP4 A3B-shaped models (B = 1, 64) alone, on the tree as it
  # is (main, merged): ~60 s warm, more on a cold Triton cache (it ran out of its 45 / 60 s slots in both calls)
  timeout ${T_ENGINE:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --junitxml=$R/test_engine_graphs_gpu.xml \
    "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]" \
    > $R/engine.log 2>&1; el engine; tail -3 $R/engine.log
  ;;
*) echo "usage: $0 sweep|ab|engine"; exit 2 ;;
esac
