#!/usr/bin/env bash
# Small-batch decode (#15) round 3, device calls (repo root as cwd; each stage under `timeout`):
#   bash tools/gpu_small_r3.sh sweep   the gemv sweep over the four latency-bound fused projections (K = 4096 out
#                                      projections, shared-expert down, router + shared gate_up) at M = 1,2,4,8 with
#                                      the narrow / long FMA tiles and 8-warp configs -> $OUT/sweep.tgz (gemv.md,
#                                      gemv.json, skinny_table.json = kernels/gemv/tuned.json updated by the sweep);
#                                      then gdn.in_proj and attn.qkv at M = 1 on top (gemv_m1/skinny_table.json)
#   bash tools/gpu_small_r3.sh ab      bench batched npl 1,8,128 (no profiles) on the tree as it came (main: the
#                                      current default), then on the overlay (.gpu/$BR copied over) with LINRNN_PDL=0,
#                                      then with LINRNN_PDL=1; the gemv kernel GPU tests under PDL -> $OUT/ab.tgz
#   bash tools/gpu_small_r3.sh final   main's tree, then the overlay's defaults with profiles at npl 1 and 128 +
#                                      component tables (bench batched npl 1,8,128); gemv / fused-decode kernel GPU
#                                      tests -> $OUT/final.tgz
#   bash tools/gpu_small_r3.sh kl      (<= 9 min) the default model's KL on the GPU: the fused kernels vs the
#                                      unfused ones at tau = inf (n_ctx 256), the tau = 16 gate at n_ctx 1024
#                                      -> $OUT/kl.tgz
#   bash tools/gpu_small_r3.sh tests   (~10 min) the gemv / fused-decode kernel GPU tests and the engine GPU tests
#                                      (graphs on == off) in full, PDL on -> $OUT/tests.tgz
#   bash tools/gpu_small_r3.sh closing the final profiles, the tau = 16 KL gate and the GPU tests in one call (what
#                                      ran when the budget allowed one call for both) -> $OUT/closing.tgz
. tools/device_env.sh >/dev/null
R=/tmp/r3; mkdir -p $R; FINAL=${OUT:-/tmp/out}; mkdir -p $FINAL
BR=${BR:-small-decode}
case "$1" in
sweep)
  [ -d .gpu/$BR ] && cp -r .gpu/$BR/. ./
  mkdir -p $R/gemv $R/gemv_m1
  timeout 150 python3 -m linrnn_bench.kernels.gemv --out $R/gemv --m 1,2,4,8 \
    --only gdn.out_proj,attn.o_proj,shared.down,router --base-table kernels/gemv/tuned.json 2>&1 \
    | grep -vE "Warning|warn" > $R/gemv/sweep.log
  # then the two large plain / conv projections at one row, on top of that table
  timeout 60 python3 -m linrnn_bench.kernels.gemv --out $R/gemv_m1 --m 1 --only gdn.in_proj,attn.qkv \
    --base-table $R/gemv/skinny_table.json 2>&1 | grep -vE "Warning|warn" > $R/gemv_m1/sweep.log
  for d in gemv gemv_m1; do
    grep -E "precompiled|not timed" $R/$d/sweep.log | head -5
    grep -E "^(gdn|attn|shared|router)" $R/$d/sweep.log | grep -E "M= ?[18] " | cut -c1-200
    grep -E "^Per decode|^max_m" $R/$d/sweep.log
  done
  tar czf $FINAL/sweep.tgz -C /tmp r3 ;;
ab)
  # one run each, same machine: main's tree (the current default), the overlay without PDL, the overlay with PDL
  # (the overlay's default since); then the skinny GEMM / fused router GPU tests under PDL
  B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,128 --no-progress --vllm-ref"
  timeout 80 $B --config 'model=qwen35moe-nvfp4,label=main (current default)' --out $R/main > $R/main.log 2>&1
  grep -E "^\| 128 \| 128|Error" $R/main/batched.md $R/main.log | head -5
  cp -r .gpu/$BR/. ./
  LINRNN_PDL=0 timeout 70 $B --config "model=qwen35moe-nvfp4,label=$BR" --out $R/new > $R/new.log 2>&1
  grep -E "^\| 128 \| 128|Error" $R/new/batched.md $R/new.log | head -5
  LINRNN_PDL=1 timeout 70 $B --config "model=qwen35moe-nvfp4,label=$BR + LINRNN_PDL=1" --out $R/new_pdl > $R/new_pdl.log 2>&1
  grep -E "^\| 128 \| 128|Error" $R/new_pdl/batched.md $R/new_pdl.log | head -5
  LINRNN_PDL=1 timeout 25 python3 -m pytest -m gpu tests/test_gemv_kernels.py -q -p no:cacheprovider -rfE \
    > $R/tests_pdl.log 2>&1; tail -1 $R/tests_pdl.log; grep -E "FAILED|ERROR" $R/tests_pdl.log | head -5
  tar czf $FINAL/ab.tgz -C /tmp r3 ;;
final)
  # the closing run, main (the current default) then the overlay's defaults, one machine: bench batched npl 1,8,128,
  # profiles at npl 1 and 128 for the overlay + component tables; the gemv / fused-decode kernel GPU tests (fused
  # kernels vs their naive compositions at the 35B shapes, graph replay bit-identical), PDL on (the default)
  B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,128 --no-progress --vllm-ref"
  timeout 75 $B --config 'model=qwen35moe-nvfp4,label=main (current default)' --out $R/main > $R/main.log 2>&1
  grep -E "^\| 128 \| 128|Error" $R/main/batched.md $R/main.log | head -5
  cp -r .gpu/$BR/. ./
  timeout 95 $B --profile 1,128 --profile-top 90 --config "model=qwen35moe-nvfp4,label=$BR (round 3 defaults)" \
    --out $R/final > $R/final.log 2>&1
  grep -E "^\| 128 \| 128|^profile:|Error" $R/final/batched.md $R/final.log | head -8
  [ -f $R/final/batched.json ] && python3 -m linrnn_bench.step_components $R/final/batched.json \
    --out $R/final/components.md > /dev/null
  timeout 60 python3 -m pytest -m gpu tests/test_gemv_kernels.py tests/test_fused_decode.py -q -p no:cacheprovider \
    -rfE > $R/tests_kernels.log 2>&1; tail -1 $R/tests_kernels.log; grep -E "FAILED|ERROR" $R/tests_kernels.log | head
  tar czf $FINAL/final.tgz -C /tmp r3 ;;
kl)
  # for a call of up to 600 s (the lead's): what the fused kernels alone move at tau = inf (the unfused kernels'
  # log-probs as the reference; --save-ref alone runs its model twice), then the tau = 16 gate at n_ctx 1024 (256
  # is in closing); eager decode of the default model took up to ~0.1 s per step in the closing call
  [ -d .gpu/$BR ] && cp -r .gpu/$BR/. ./
  KL="python3 -m linrnn_serve kl-gate --model default --device cuda --scoring decode --batch 32"
  LINRNN_SKINNY_GEMM=0 LINRNN_FUSED_ROUTER=0 LINRNN_FUSED_ROPE_KV=0 timeout 150 $KL --ctx 256 \
    --ref ssm-bf16-tau=inf --save-ref $R/unfused_ref.pt > $R/kl_unfused_ref.log 2>&1
  timeout 100 $KL --ctx 256 --compare-ref $R/unfused_ref.pt --test ssm-bf16-tau=inf \
    --out $R/kl_fused_vs_unfused > $R/kl_fused.log 2>&1
  grep -E "^\||KL gate" $R/kl_fused.log | tail -4; rm -f $R/unfused_ref.pt
  timeout 300 $KL --ctx 1024 --ref ssm-bf16-tau=inf --test ssm-bf16-tau=16 --out $R/kl_tau16 > $R/kl_tau16.log 2>&1
  grep -E "^\||KL gate" $R/kl_tau16.log | tail -4
  tar czf $FINAL/kl.tgz -C /tmp r3 ;;
tests)
  # the GPU tests the closing call cut short (PDL on, the default), for a call of up to 600 s
  [ -d .gpu/$BR ] && cp -r .gpu/$BR/. ./
  timeout 250 python3 -m pytest -m gpu tests/test_gemv_kernels.py tests/test_fused_decode.py -q -p no:cacheprovider \
    -rfE > $R/tests_kernels.log 2>&1; tail -1 $R/tests_kernels.log; grep -E "FAILED|ERROR" $R/tests_kernels.log | head
  timeout 300 python3 -m pytest -m gpu tests/test_engine_gpu.py -k "a3b or tiny" -q -p no:cacheprovider -rfE \
    > $R/tests_engine.log 2>&1; tail -1 $R/tests_engine.log; grep -E "FAILED|ERROR" $R/tests_engine.log | head
  tar czf $FINAL/tests.tgz -C /tmp r3 ;;
closing)
  # final + kl in one call (the session's device budget allowed one more): the overlay's defaults with profiles at
  # npl 1 and 128 + component tables; the KL gate tau = inf vs 16 on the GPU with the fused kernels; engine GPU tests
  # (graphs on == off, PDL on); then the kernel GPU tests with what time is left
  cp -r .gpu/$BR/. ./
  timeout 80 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,128 --no-progress \
    --vllm-ref --profile 1,128 --profile-top 90 --config "model=qwen35moe-nvfp4,label=$BR (round 3 defaults)" \
    --out $R/final > $R/final.log 2>&1
  grep -E "^\| 128 \| 128|^profile:|Error" $R/final/batched.md $R/final.log | head -8
  [ -f $R/final/batched.json ] && python3 -m linrnn_bench.step_components $R/final/batched.json \
    --out $R/final/components.md > /dev/null
  timeout 75 python3 -m linrnn_serve kl-gate --model default --device cuda --scoring decode --batch 32 \
    --ctx 256,1024,2048 --ref ssm-bf16-tau=inf --test ssm-bf16-tau=16 --out $R/kl_tau16 > $R/kl_tau16.log 2>&1
  grep -E "^\||KL gate" $R/kl_tau16.log | tail -6
  timeout 50 python3 -m pytest -m gpu tests/test_engine_gpu.py -k "a3b or tiny" -q -p no:cacheprovider -rfE \
    > $R/tests_engine.log 2>&1; tail -1 $R/tests_engine.log; grep -E "FAILED|ERROR" $R/tests_engine.log | head -5
  timeout 20 python3 -m pytest -m gpu tests/test_gemv_kernels.py tests/test_fused_decode.py -q -p no:cacheprovider \
    -rfE > $R/tests_kernels.log 2>&1; tail -1 $R/tests_kernels.log; grep -E "FAILED|ERROR" $R/tests_kernels.log | head
  tar czf $FINAL/closing.tgz -C /tmp r3 ;;
esac
