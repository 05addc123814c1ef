#!/usr/bin/env bash
# NVFP4 MoE decode, round 7 (issue #13): the down GEMM's own tile (experts.MMA_DOWN_TILES: 1 unit at a register budget
# of 40, 12 CTAs per SM) against the common tile (LINRNN_MMA_DOWN_TILES=0 / candidate "down tile off"); round 8 ran its
# candidates through it too (CANDS, PASSES, BS, NPL, the floor stage; benchmarks/results/kernels/moe/round8/).
# Device calls on one H200 (LINRNN_COMMIT=<sha>; stages comma-separated, results under $OUT/moe_r7):
#   tests   tests/test_nvfp4_mma.py GPU cases (-n 4; MMA_K: a -k selection) and the engine's graphs-on == graphs-off greedy tests (~150 s)
#   layer   the `moe` layer benchmark B = 1 .. 256: nvfp4/mma, nvfp4/asm (the old kernel), bf16/ours, copy bandwidth,
#           candidates CANDS (default: default / down tile off), per-launch profile; PASSES passes (default two,
#           fresh routing each) over BS (~140 s)
#   engine  bench batched NVFP4 f32 at NPL (default 1-128), AB_VAR (default LINRNN_MMA_DOWN_TILES) 1 and 0, one process
#           each (~230 s)
#   floor   tools/graph_floor.py: the layer timing's floor (a one-kernel graph replay)
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
R=$OUT/moe_r7
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
  done
fi
if has "$1" engine; then
  for tiles in 1 0; do
    env ${AB_VAR:-LINRNN_MMA_DOWN_TILES}=$tiles timeout 200 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 \
      --ntg 128 --npl ${NPL:-1,8,32,64,128} --config "model=qwen35moe-nvfp4,label=nvfp4 f32 down tiles $tiles" --vllm-ref \
      --no-progress --out $R/batched_$tiles > $R/batched_$tiles.log 2>&1; el "batched down tiles $tiles"
    grep -E "^\| 128 \| 128 \|" $R/batched_$tiles/batched.md | head -6
  done
fi
if has "$1" floor; then
  python3 tools/graph_floor.py | tee $R/graph_floor.json
fi
