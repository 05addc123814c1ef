#!/usr/bin/env bash
# Small-batch decode (#15 npl 1 / 8, #13 B = 1 layer) round 4, device calls (repo root as cwd; every stage under
# `timeout`; the tree as it came is main, .gpu/$BR the branch's overlay):
#   bash tools/gpu_small_r4.sh ab     main's tree: bench batched npl 1,8 (PDL on; then PDL off with the per-kernel
#                                     profile at npl 1 and 8) and the MoE layer benchmark (B = 1, 8);
#                                     then the overlay: the changed kernels' GPU tests (pair blocks == expert-sorted alignment bit for
#                                     bit, vs naive, graphs; the fused router at 35B shapes), old vs new outputs bit for bit
#                                     (tools/gpu_small_r4_bits.py: skinny GEMM row-norm epilogues, router + experts), the MoE layer benchmark,
#                                     bench batched npl 1,8 (PDL on, the default), and with LINRNN_PDL=0 the per-kernel
#                                     profile at npl 1 and 8 -> $OUT/r4/
#   bash tools/gpu_small_r4.sh final  (main's tree as merged, timeout_s 360) bench batched npl 1,8 with the defaults +
#                                     profile; engine GPU test graphs on == off (35B-shaped NVFP4); MMA / pair-block /
#                                     router GPU tests; the MoE layer benchmark -> $OUT/r4/final_*.log
#                                     (the LINRNN_MMA_PDL=1 stages of the call on ce30243 went with the opt-in:
#                                     benchmarks/results/small_round4/variants/gpu_small_r4_final_pdl.sh.txt)
. tools/device_env.sh >/dev/null
# results straight under $OUT (whatever a stage left comes back if the call runs out of time)
R=${OUT:-/tmp/out}/r4; mkdir -p $R
BR=${BR:-small-decode}
B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8 --no-progress"
MOE="python3 -m linrnn_bench.kernels.moe --batch-sizes 1,8 --variants nvfp4/mma,nvfp4/mma-parts,nvfp4/mma-route"
row() { grep -E "\| 128 \| 128 \||^profile:|Error" "$@" | cut -c1-160 | head -6; }
case "$1" in
ab)
  timeout 60 $B --config 'model=qwen35moe-nvfp4,label=main' --out $R/main > $R/main.log 2>&1; row $R/main/batched.md $R/main.log
  LINRNN_PDL=0 timeout 60 $B --profile 1,8 --profile-top 40 --config 'model=qwen35moe-nvfp4,label=main LINRNN_PDL=0' \
    --out $R/main_pdl0 > $R/main_pdl0.log 2>&1; row $R/main_pdl0/batched.md $R/main_pdl0.log
  grep -E "router_kernel|nvfp4_mma|align|skinny" $R/main_pdl0/batched.md | head -6
  timeout 45 python3 .gpu/$BR/tools/gpu_small_r4_bits.py save /tmp/bits_main.pt > $R/bits_main.log 2>&1; tail -1 $R/bits_main.log
  timeout 45 $MOE --out $R/moe_main > $R/moe_main.log 2>&1; grep -E "^\| (1|8) \|" $R/moe_main.log | head -4
  cp -r .gpu/$BR/. ./
  timeout 45 python3 tools/gpu_small_r4_bits.py compare /tmp/bits_main.pt > $R/bits.log 2>&1; grep -E "DIFFERS|cases|Error" $R/bits.log
  timeout 60 $B --config "model=qwen35moe-nvfp4,label=$BR" --out $R/new > $R/new.log 2>&1; row $R/new/batched.md $R/new.log
  LINRNN_PDL=0 timeout 60 $B --profile 1,8 --profile-top 40 --config "model=qwen35moe-nvfp4,label=$BR LINRNN_PDL=0" \
    --out $R/new_pdl0 > $R/new_pdl0.log 2>&1; row $R/new_pdl0/batched.md $R/new_pdl0.log
  grep -E "router_kernel|nvfp4_mma|align|skinny" $R/new_pdl0/batched.md | head -6
  timeout 80 python3 -m pytest -m gpu tests/test_nvfp4_mma.py tests/test_gemv_kernels.py -k "pair or router or bitwise or graph" \
    -q -p no:cacheprovider -rfE > $R/tests_ab.log 2>&1; tail -1 $R/tests_ab.log; grep -E "FAILED|ERROR" $R/tests_ab.log | head -5
  timeout 45 $MOE --out $R/moe_new > $R/moe_new.log 2>&1; grep -E "^\| (1|8) \|" $R/moe_new.log | head -4
  ;;
final)
  # one call (~6 min) on main's tree as merged: bench batched npl 1,8 with the defaults (PDL on) and the profile; the
  # engine GPU test graphs on == off (35B-shaped NVFP4, batches 1 / 3 / 17 / 64); the MMA / pair-block / router GPU
  # tests; the MoE layer benchmark. One log per stage under $R
  timeout 75 $B --profile 1,8 --profile-top 40 --config 'model=qwen35moe-nvfp4,label=main (defaults)' --out /tmp/r4f/main \
    > $R/final_main.log 2>&1; row $R/final_main.log; grep -E "router_kernel|nvfp4_mma|skinny" $R/final_main.log | head -6
  timeout 150 python3 -m pytest -m gpu tests/test_engine_gpu.py -k a3b -q -p no:cacheprovider -rfE \
    > $R/final_tests_engine.log 2>&1; tail -1 $R/final_tests_engine.log; grep -E "FAILED|ERROR" $R/final_tests_engine.log | head -5
  timeout 90 python3 -m pytest -m gpu tests/test_nvfp4_mma.py tests/test_gemv_kernels.py \
    -k "pair or bitwise or per_expert or dispatch or router" -q -p no:cacheprovider -rfE > $R/final_tests_kernels.log 2>&1
  tail -1 $R/final_tests_kernels.log; grep -E "FAILED|ERROR" $R/final_tests_kernels.log | head -5
  timeout 35 $MOE > $R/final_moe.log 2>&1; grep -E "^\| (1|8) \|" $R/final_moe.log | head -4
  ;;
esac
