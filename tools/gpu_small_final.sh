#!/usr/bin/env bash
# Small-batch decode (#15), the closing device call (~5 min, repo root as cwd): with the committed defaults
# (fusions on, kernels/gemv/tuned.json)
#   1. GPU tests: skinny GEMM / fused router vs their naive compositions, the fused decode step vs the
#      reference ops, graphs on == off (bit-exact) on the A3B-shaped engine
#   2. bench batched 35B-A3B NVFP4 dummy, f32 state, npl 1,8,128, profiles at npl 1 and 128 (+ component
#      tables): unfused (all three switches 0), fused (defaults), fused + LINRNN_PDL=1, fused +
#      LINRNN_FUSED_MOE_COMBINE=1 (the experts' combine inside the shared expert's down projection; its kernel
#      tests run first with the switch on)
# Results in $OUT/final.tgz; prints the test summaries, the rows and the component tables.
. tools/device_env.sh >/dev/null
R=/tmp/final; mkdir -p $R; FINAL=${OUT:-/tmp/out}; mkdir -p $FINAL
timeout 150 python3 -m pytest -m gpu tests/test_gemv_kernels.py tests/test_fused_decode.py -q -p no:cacheprovider \
  -rfE > $R/tests_kernels.log 2>&1; tail -2 $R/tests_kernels.log; grep -E "FAILED|ERROR" $R/tests_kernels.log | head
timeout 150 python3 -m pytest -m gpu tests/test_engine_gpu.py -k "a3b or tiny" -q -p no:cacheprovider -rfE \
  > $R/tests_engine.log 2>&1; tail -2 $R/tests_engine.log; grep -E "FAILED|ERROR" $R/tests_engine.log | head
LINRNN_FUSED_MOE_COMBINE=1 timeout 120 python3 -m pytest tests/test_gemv_kernels.py tests/test_fused_decode.py \
  -k "combines or match_reference" -q -p no:cacheprovider -rfE > $R/tests_combine.log 2>&1
tail -1 $R/tests_combine.log; grep -E "FAILED|ERROR" $R/tests_combine.log | head
B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,128 --vllm-ref --profile 1,128 --profile-top 90 --no-progress"
run() {  # label, env...
  local label=$1; shift
  env "$@" timeout 120 $B --config "model=qwen35moe-nvfp4,label=$label" --out $R/$label > $R/$label.log 2>&1
  grep -E "^\| 128 \| 128|^profile:" $R/$label/batched.md | sed "s/^/$label: /"
  [ -f $R/$label/batched.json ] && python3 -m linrnn_bench.step_components $R/$label/batched.json \
    --out $R/$label/components.md > /dev/null
}
run unfused LINRNN_SKINNY_GEMM=0 LINRNN_FUSED_ROUTER=0 LINRNN_FUSED_ROPE_KV=0
run fused LINRNN_PDL=0
run fused_pdl LINRNN_PDL=1
run fused_combine LINRNN_FUSED_MOE_COMBINE=1
cat $R/fused/components.md
tar czf $FINAL/final.tgz -C /tmp final
