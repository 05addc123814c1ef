#!/usr/bin/env bash
# Lead's final device calls on one H200, on the merged tree. Pass the real commit: LINRNN_COMMIT=<sha>.
#   bash tools/gpu_final.sh T   # <= 8 min: every GPU test (kernel files in parallel, engine files one at a time;
#                               # KERNEL_TESTS="tests/x.py ..." adds kernel test files, GPU_TESTS files run with -m gpu)
#   bash tools/gpu_final.sh A   # ~5 min: headline batched decode (f32 and tau=16, npl 1-128,
#                               # vs vLLM 0.26, profiles at npl 1 / 128); grammar-mask cost at npl 32
#   bash tools/gpu_final.sh B   # ~5 min: serving through the engine-core process (c = 1, 64); prefix-caching
#                               # benefit (multi-turn on / off)
#   bash tools/gpu_final.sh AG  # A, then the GDN decode kernels vs the code before the blocked bf16 layout (gpu_gdn_bf16.sh
#                               # check,bench: bit-identity and the registry benchmark, old and new in one run)
#   bash tools/gpu_final.sh K   # ~3 min: the KL gate on the GPU (default model, decode scoring, n_ctx 256): the
#                               # default (fused) kernels vs the unfused ones at tau = inf, and tau = 16 vs the unfused
#   bash tools/gpu_final.sh AH  # A without the grammar stage, then H
#   bash tools/gpu_final.sh AKH # ~7 min: A without the grammar stage, then K, then H
#   bash tools/gpu_final.sh W   # ~5 min: #14's serving lines (gpu_wave_round.sh: bench batched npl 1 / 64 and one
#                               # default server at c = 1, 64, 64); WT=1 adds #16's benefit pair (gpu_ttft.sh: on / off)
#   bash tools/gpu_final.sh AK  # ~8 min: A without the grammar stage, then K
#   bash tools/gpu_final.sh F   # ~7 min, one call for everything that must be re-measured on the final tree: A's
#                               # headline batched (its f32 npl 64 row is the S_TG of #14's c = 64 line), then the
#                               # default server at c = 1, 64, 64 and a --no-burst-head-start control at c = 64
#                               # (gpu_wave_round.sh's report), then the MoE layer's L2-flush check and K while
#                               # FINAL_BUDGET (default 520 s) lasts
#   bash tools/gpu_final.sh H   # ~1 min: the CPU host-overhead benchmark (stubbed forward, no GPU) on this
#                               # machine's 16 cores, where the core, the API server and 128 clients each get one
# Results under $OUT (tarballs + short tables).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; R=/tmp/final; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PYT="python3 -m pytest -q -p no:cacheprovider -rfE"

part_t() {
  # kernel files compiled on CUDA (background, little memory) and the engine-level GPU tests (foreground,
  # one at a time: each engine reserves most of the GPU's memory, with -n 3 they ran out)
  ( timeout 300 $PYT tests/test_gemv_kernels.py tests/test_fused_decode.py tests/test_nvfp4_mma.py tests/test_moe_kernels.py \
      tests/test_norm_kernels.py tests/test_gdn_kernels.py tests/test_attention_kernels.py $KERNEL_TESTS -n 4 --dist loadfile \
      --timeout 250 > $R/tests_kernels.log 2>&1; echo "rc $?" >> $R/tests_kernels.log ) &
  local A=$!
  timeout 480 $PYT -m gpu tests/test_engine_gpu.py tests/test_structured_gpu.py tests/test_prefix_gpu.py \
    tests/test_prefill_graphs.py tests/test_overlap_gpu.py tests/test_tensor_parallel_gpu.py tests/test_quant_checkpoints.py $GPU_TESTS \
    --timeout 250 > $R/tests_engine.log 2>&1; echo "rc $?" >> $R/tests_engine.log
  wait $A
  el "tests done"
  for f in kernels engine; do tail -2 $R/tests_$f.log; grep -E "^(FAILED|ERROR)" $R/tests_$f.log | head -12; done
  tar czf $OUT/final_t.tgz -C /tmp final
}

part_a() {
  timeout 270 python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 128 --npl 1,8,32,64,128 \
    --config "model=qwen35moe-nvfp4,label=nvfp4 f32" --config "model=qwen35moe-nvfp4,ssm-bf16-tau=16,label=nvfp4 tau=16" \
    --vllm-ref --profile 1,128 --no-progress --out $R/batched > $R/batched.log 2>&1
  el "batched done"; grep -E "^\| (PP|128)|^## |^profile" $R/batched/batched.md | head -40
  [ -f $R/batched/batched.json ] && python3 -m linrnn_bench.step_components $R/batched/batched.json \
    --out $R/batched/components.md > /dev/null 2>&1
  [ -n "$SKIP_SO" ] && { tar czf $OUT/final_a.tgz -C /tmp final; return; }
  timeout 90 python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg 64 \
    --npl 32 --structured-output --no-progress --out $R/batched_so > $R/batched_so.log 2>&1
  el "structured done"; grep -E "structured|grammar" $R/batched_so.log | tail -3
  tar czf $OUT/final_a.tgz -C /tmp final
}

serve_bench() {  # label port [env...]: in 128 / out 128 at c = 1 and 64
  local label=$1 port=$2; shift 2
  env "$@" python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port $port \
    --max-num-seqs 64 --disable-log-requests > $R/server_$label.log 2>&1 &
  local S=$!
  for i in $(seq 1 150); do curl -sf 127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  timeout 100 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:$port --input-len 128 --output-len 128 \
    --max-concurrency 1,64 --out $R/serve_$label.json > $R/serve_$label.log 2>&1
  kill -INT $S; sleep 3; kill -9 $S 2>/dev/null; wait $S 2>/dev/null
  python3 - $R/serve_$label.json $label <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"| {sys.argv[2]} | {r['max_concurrency']} | {r['ttft_ms']['median']:.1f} | {r['tpot_ms']['median']:.2f} | "
          f"{r['itl_ms']['median']:.2f} | {r['output_throughput']:.0f} | {r['failed']} |")
PY
}

part_b() {
  echo "| server | concurrency | TTFT median ms | TPOT median ms | ITL median ms | out tok/s | failed |"
  echo "|---|---:|---:|---:|---:|---:|---:|"
  serve_bench core_process 8014
  el "serve done"
  OUT=$R bash tools/gpu_prefix.sh on > $R/prefix_on.log 2>&1
  OUT=$R bash tools/gpu_prefix.sh off > $R/prefix_off.log 2>&1
  OUT=$R bash tools/gpu_prefix.sh report
  el "prefix done"
  rm -f $R/*.tgz; tar czf $OUT/final_b.tgz -C /tmp final
}

part_h() {
  # the CPU host-overhead benchmark on this machine's 16 cores (tools/gpu_host.sh: three repeats, the step's phases)
  OUT=$R/host timeout 150 bash tools/gpu_host.sh > $R/host.log 2>&1
  el "host overhead done"; cat $R/host/gpu_host.md 2>/dev/null | head -30
  tar czf $OUT/final_h.tgz -C /tmp final
}

part_k() {
  # what the default kernels move against the unfused ones (cuBLAS projections, separate router, RoPE and KV
  # write) at tau = inf, and tau = 16 against the same reference (kl_gate/gpu_fused_kernels/ has the first run)
  local KL="python3 -m linrnn_serve kl-gate --model default --device cuda --scoring decode --batch 32 --ctx 256"
  LINRNN_SKINNY_GEMM=0 LINRNN_FUSED_ROUTER=0 LINRNN_FUSED_ROPE_KV=0 timeout 150 $KL \
    --ref ssm-bf16-tau=inf --save-ref $R/unfused_ref.pt > $R/kl_unfused_ref.log 2>&1
  timeout 100 $KL --compare-ref $R/unfused_ref.pt --test ssm-bf16-tau=inf --out $R/kl_fused > $R/kl_fused.log 2>&1
  timeout 100 $KL --compare-ref $R/unfused_ref.pt --test ssm-bf16-tau=16 --out $R/kl_tau16 > $R/kl_tau16.log 2>&1
  rm -f $R/unfused_ref.pt
  el "kl done"; grep -hE "kl-gate: n_ctx" $R/kl_fused.log $R/kl_tau16.log
  tar czf $OUT/final_k.tgz -C /tmp final
}

case "${1:-A}" in
  T) part_t ;;
  A) part_a ;;
  B) part_b ;;
  H) part_h ;;
  W) OUT=$R/wave SERVE_FLAGS="" TA=${TA:-160} BUDGET=${WAVE_BUDGET:-330} bash tools/gpu_wave_round.sh; el "wave done"
     if [ -n "${WT-}" ]; then
       OUT=$R/ttft BUDGET=${TTFT_BUDGET:-200} bash tools/gpu_ttft.sh > $R/ttft.log 2>&1; el "ttft done"
       tail -40 $R/ttft/ttft_report.md
     fi
     tar czf $OUT/final_w.tgz -C /tmp final ;;
  F) SKIP_SO=1 part_a; mkdir -p $R/wave; cp -r $R/batched $R/wave/batched
     # the default server at c = 1, 64, 64, then each further '|' flag set (F_SERVE_FLAGS) at c = 64 once, as a control
     OUT=$R/wave SERVE_FLAGS="${F_SERVE_FLAGS-|--no-burst-head-start}" CONC_REST=64 BATCHED_DONE=1 \
       BUDGET=$(( ${FINAL_BUDGET:-520} - SECONDS > 230 ? 230 : ${FINAL_BUDGET:-520} - SECONDS )) \
       bash tools/gpu_wave_round.sh; el "wave done"
     # the MoE layer behind do_bench's zeroing L2 flush and behind a reading one (does the flush's write-back inflate it?)
     if [ $(( ${FINAL_BUDGET:-520} - SECONDS )) -ge 110 ]; then
       OUT=$R T_FLUSH=50 timeout 105 bash tools/gpu_moe_small.sh flush > $R/moe_flush.log 2>&1; el "flush done"
       tail -25 $R/moe_flush.log
     fi
     [ $(( ${FINAL_BUDGET:-520} - SECONDS )) -ge 170 ] && part_k
     rm -f $OUT/final_*.tgz; tar czf $OUT/final_f.tgz -C /tmp final ;;
  AK) SKIP_SO=1 part_a; part_k; rm -f $OUT/final_a.tgz $OUT/final_k.tgz; tar czf $OUT/final_ak.tgz -C /tmp final ;;
  K) part_k ;;
  AH) SKIP_SO=1 part_a; part_h; rm -f $OUT/final_a.tgz $OUT/final_h.tgz; tar czf $OUT/final_ah.tgz -C /tmp final ;;
  AKH) SKIP_SO=1 part_a; part_k; part_h; rm -f $OUT/final_a.tgz $OUT/final_k.tgz $OUT/final_h.tgz
       tar czf $OUT/final_akh.tgz -C /tmp final ;;
  AG) part_a; OUT=$R bash tools/gpu_gdn_bf16.sh check,bench; el "gdn done"; rm -f $OUT/final_a.tgz
      tar czf $OUT/final_ag.tgz -C /tmp final ;;
esac
