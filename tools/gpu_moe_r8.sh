#!/usr/bin/env bash
# NVFP4 MoE decode, round 8 (issue #13): the candidates of benchmarks/results/kernels/moe/round8/ (their kernel diffs are
# under round8/variants/) and the LINRNN_MMA_DOWN_TILES engine A/B.
# Device call on one H200 (LINRNN_COMMIT=<sha>; stages comma-separated, results under $OUT/moe_r8):
#   tests   tests/test_nvfp4_mma.py GPU cases (MMA_K: a -k selection) and the engine's graphs-on == off tests (~230 s)
#   layer   the `moe` layer benchmark (BS batch sizes), nvfp4/mma, nvfp4/asm, bf16/ours, per-launch profile, the
#           candidates CANDS; PASSES passes (fresh routing each)
#   engine  bench batched NVFP4 f32 at NPL (default 1,8), LINRNN_MMA_DOWN_TILES on and off, one process each
#   floor   tools/graph_floor.py: the layer timing's floor (a one-kernel graph replay)
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/moe_r8
mkdir -p $R
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
echo "commit ${LINRNN_COMMIT:-?}"
has() { [[ ",$1," == *",$2,"* ]]; }
if has "$1" tests; then
  timeout 200 python3 -m pytest -q -n 4 -m gpu tests/test_nvfp4_mma.py ${MMA_K:+-k "$MMA_K"} -p no:cacheprovider -rfE \
    --junitxml=$R/test_nvfp4_mma_gpu.xml > $R/tests.log 2>&1; el tests; tail -1 $R/tests.log
  timeout 200 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -k "graph" -p no:cacheprovider -rfE \
    --junitxml=$R/test_engine_gpu.xml > $R/tests_engine.log 2>&1; el engine tests; tail -1 $R/tests_engine.log
  grep -hE "^(FAILED|ERROR)" $R/tests*.log | head -8
fi
if has "$1" layer; then
  for p in ${PASSES:-1 2}; do
    timeout 200 python3 -m linrnn_bench.kernels.moe --variants nvfp4/mma,nvfp4/asm,bf16/ours --sets 3 --rep 100 \
      --profile --mma-sweep --mma-candidates "${CANDS:-default,down tile off}" --flush read \
      --batch-sizes ${BS:-1,8,16,32,64,128,256} --out $R/layer$p > $R/layer$p.log 2>&1; el "layer pass $p"
    grep -E "^\| [0-9]+ \| [0-9]+ \| " $R/layer$p/moe_*.md | head -8
    grep -A10 "layer time per variant" $R/layer$p/moe_*.md | grep -E "^\| [0-9]+ \|"
    grep "^profile" $R/layer$p.log | head -4
  done
fi
if has "$1" engine; then
  for tiles in 1 0; do
    LINRNN_MMA_DOWN_TILES=$tiles timeout 200 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 \
      --ntg 128 --npl ${NPL:-1,8} --config "model=qwen35moe-nvfp4,label=nvfp4 f32 down tiles $tiles" --vllm-ref \
      --no-progress --out $R/batched_$tiles > $R/batched_$tiles.log 2>&1; el "batched down tiles $tiles"
    grep -E "^\| 128 \| 128 \|" $R/batched_$tiles/batched.md | head -6
  done
fi
if has "$1" floor; then
  python3 tools/graph_floor.py | tee $R/graph_floor.json
fi
