#!/usr/bin/env bash
# NVFP4 MoE prefill kernel (issue #13 build item 4, nvfp4_wgmma.py), one device call on an H200:
# (A) the GPU tests of the wgmma path (tests/test_nvfp4_wgmma.py -m gpu: equality with naive, skewed loads,
#     NaN-poisoned buffers, bitwise / CUDA-graph replays, the path choice);
# (B) one MoE layer (35B-A3B shapes, CUDA-graph replays) at B = 128 .. 8192 tokens: the new kernel (by block
#     size), the engine's default path (nvfp4/mma = what experts.moe_experts picks), the MMA decode kernel, the
#     old grouped GEMM, dequantize + bf16 and the bf16-weights path in one run, with routed-GEMM TFLOP/s;
# (C) ENGINE=1: bench batched --npp 2048 --ntg 16 --npl 1,8 and --npp 128 --ntg 128 --npl 128 (S_PP; ENGINE_SPP=1:
#     only --npp 128 --ntg 128 --npl 64,128); ENGINE_AB=1
#     adds the 2048 run with the wgmma path off (LINRNN_NVFP4_WGMMA=0); SKIP_BENCH=1 skips (B);
# (D) PREFIX=on|off|report: that stage of tools/gpu_prefix.sh (issue #16's TTFT benefit; on / off ~3-5 min each);
# OVERLAY=1 (OLD_DIR=<dir with kernels/moe/{nvfp4_wgmma,experts,align}.py of the old commit>): the layer at SIZES with
#     the old and the new wgmma path in one process (tools/gpu_wgmma_overlay.py; OVERLAY_ARGS: more bench flags, e.g.
#     --profile for device time per kernel); ENGINE_TESTS=1: the engine's graphs-on ==
#     graphs-off test at NVFP4 A3B shapes, B = 1 and 64 (a 64-prompt prefill takes the wgmma path). TESTS_K: pytest -k.
# EXTRA_TESTS: more pytest node ids / files run first (unmarked CPU tests run on the GPU there, e.g. the alignment).
# PICK_TILE=1 (after OVERLAY): the engine stages run on the fastest -n..-x.. overlay variant (LINRNN_WGMMA_TILE) if it
#     beats nvfp4/wgmma by >= 3 % at the largest size and is nowhere > 1 % slower; $OUT/picked_tile.txt says which.
# LINRNN_COMMIT=<sha> bash tools/gpu_moe_prefill.sh   -> $OUT/moe_prefill_* (tables), $OUT/*.log
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
filt() { grep -vE "leaked|nanobind|^ - |Warning|warn_once|See https"; }
[ -n "${EXTRA_TESTS:-}" ] && timeout ${T_EXTRA:-120} python3 -m pytest -q $EXTRA_TESTS -p no:cacheprovider \
  --junitxml=$OUT/test_extra_gpu.xml 2>&1 | filt | tail -8
timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu tests/test_nvfp4_wgmma.py -p no:cacheprovider -x ${TESTS_K:+-k "$TESTS_K"} \
  --junitxml=$OUT/test_nvfp4_wgmma_gpu.xml 2>&1 | filt | tail -15
el "tests done"
[ -z "${SKIP_BENCH:-}" ] && timeout ${T_BENCH:-200} python3 -m linrnn_bench.kernels.moe --batch-sizes ${SIZES:-128,512,1024,2048,4096,8192} \
  --variants ${VARIANTS:-nvfp4/mma,nvfp4/wgmma,nvfp4/wgmma-n64-w4-u1,nvfp4/wgmma-n128-w8-u2,nvfp4/mma-any,nvfp4/asm,nvfp4/dequant-bf16,bf16/ours} \
  --sets 1 --warmup 10 --rep ${REP:-30} --out $OUT/moe_prefill 2>&1 | filt | grep -v "^{" | tail -40
cp $OUT/moe_prefill/*.md $OUT/moe_prefill_table.md 2>/dev/null; cp $OUT/moe_prefill/*.json $OUT/moe_prefill.json 2>/dev/null
rm -rf $OUT/moe_prefill
el "bench done"
if [ -n "${OVERLAY:-}" ]; then  # old (OLD_DIR: main's nvfp4_wgmma.py + experts.py) vs new in one bench process
  timeout ${T_OVERLAY:-150} python3 tools/gpu_wgmma_overlay.py --batch-sizes ${SIZES:-512,1024,2048,4096,8192} \
    --variants ${OVERLAY_VARIANTS:-nvfp4/wgmma-old,nvfp4/wgmma,nvfp4/mma} --sets 1 --warmup 10 --rep ${REP:-30} ${OVERLAY_ARGS:-} \
    --out $OUT/overlay 2>&1 | filt | grep -v "^{" | tail -30
  cp $OUT/overlay/*.md $OUT/overlay_table.md 2>/dev/null; cp $OUT/overlay/*.json $OUT/overlay.json 2>/dev/null
  rm -rf $OUT/overlay
  el "overlay done"
fi
if [ -n "${PICK_TILE:-}" ] && [ -f $OUT/overlay.json ]; then  # the engine runs on the fastest measured tile
  # (LINRNN_WGMMA_TILE) where one beats the default by >= 3 % at the largest size and is not slower (> 1 %) at any
  export LINRNN_WGMMA_TILE=$(python3 - $OUT/overlay.json <<'PY'
import json, re, sys
rows = json.load(open(sys.argv[1]))["rows"]
us = lambda r, v: r["us"].get(v) if isinstance(r["us"].get(v), float) else None
best, best_us = "", None
big = max(rows, key=lambda r: r["B"])
for v in rows[0]["us"]:
    m = re.fullmatch(r"nvfp4/wgmma-n(\d+)-w(\d+)-u(\d+)-s(\d+)-x(\d+)", v)
    if not m or any(us(r, v) is None or us(r, "nvfp4/wgmma") is None for r in rows):
        continue
    if us(big, v) <= 0.97 * us(big, "nvfp4/wgmma") and all(us(r, v) <= 1.01 * us(r, "nvfp4/wgmma") for r in rows):
        if best_us is None or us(big, v) < best_us:
            best, best_us = ",".join(m.groups()), us(big, v)
print(best)
PY
)
  echo "engine tile: ${LINRNN_WGMMA_TILE:-default}" | tee $OUT/picked_tile.txt
fi
if [ -n "${ENGINE_TESTS:-}" ]; then  # the engine's graphs-on == graphs-off greedy check, NVFP4 A3B shapes, B = 1 and 64
  timeout ${T_ENGINE_TESTS:-150} python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml=$OUT/test_engine_gpu.xml \
    "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[1]" "tests/test_engine_gpu.py::test_graphs_vs_eager_a3b_shaped[64]" \
    2>&1 | filt | tail -5
  el "engine tests done"
fi
if [ -n "${ENGINE:-}" ]; then  # the engine (NVFP4 35B-A3B dummy): 2048-token prompts at npl 1 / 8, S_PP at npl 128
  eng() {  # $1 out dir, $2 timeout, rest: bench batched args
    local o=$1 t=$2; shift 2
    timeout $t python3 -m linrnn_serve bench batched --load-format dummy --model qwen35moe-nvfp4 --no-progress \
      --out /tmp/$o "$@" > /tmp/$o.log 2>&1; echo "$o rc $?"
    if [ -f /tmp/$o/batched.md ]; then cp /tmp/$o/batched.md $OUT/$o.md; grep "^|" /tmp/$o/batched.md | head -12
    else tail -5 /tmp/$o.log; fi
  }
  if [ -n "${ENGINE_SPP:-}" ]; then  # only T_PP / S_PP at npl 64 and 128 (and S_TG beside them)
    eng batched_spp ${T_E2:-120} --npp 128 --ntg 128 --npl 64,128 --vllm-ref
  else
    eng batched_2048 ${T_E1:-120} --npp 2048 --ntg 16 --npl 1,8
    eng batched_128 ${T_E2:-120} --npp 128 --ntg 128 --npl 128 --vllm-ref
  fi
  [ -n "${ENGINE_AB:-}" ] && LINRNN_NVFP4_WGMMA=0 eng batched_2048_off ${T_E3:-120} --npp 2048 --ntg 16 --npl 1,8
  el "engine done"
fi
if [ -n "${PREFIX:-}" ]; then  # PREFIX=on | off | report (gpu_prefix.sh's stages; on / off take ~3-5 min each)
  timeout ${T_PREFIX:-420} bash tools/gpu_prefix.sh $PREFIX 2>&1 | filt | tail -30
  el "prefix done"
fi
