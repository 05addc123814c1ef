#!/usr/bin/env bash
# Lead's second final call of session 5 (one H200, <= 10 min): the two GPU tests the first call failed, re-run
# on the fix; the headline bench batched (f32 and tau = 16, npl 1-128, vLLM ref, profiles at npl 1 / 128); the GDN
# blocked-layout check and old-vs-new registry benchmark. Results under $OUT (one tarball).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; R=/tmp/final; mkdir -p $R $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_gdn_kernels.py tests/test_hybrid_state.py \
  --timeout 140 > $R/tests_gdn.log 2>&1; tail -2 $R/tests_gdn.log; grep -E "^(FAILED|ERROR)" $R/tests_gdn.log | head
el "gdn tests"
timeout 270 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,32,64,128 \
  --config "model=qwen35moe-nvfp4,label=nvfp4 f32" --config "model=qwen35moe-nvfp4,ssm-bf16-tau=16,label=nvfp4 tau=16" \
  --vllm-ref --profile 1,128 --no-progress --out $R/batched > $R/batched.log 2>&1
el "batched"; grep -E "^\| (PP|128)|^## |^profile" $R/batched/batched.md | head -40
tar czf $OUT/final5.tgz -C /tmp final
OUT=$R bash tools/gpu_gdn_bf16.sh check,bench
el "gdn"
tar czf $OUT/final5.tgz -C /tmp final
