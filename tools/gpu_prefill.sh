#!/usr/bin/env bash
# Short prefill in CUDA graphs (issue #14 build item 4) on one H200, ~6 min: (A) the GPU tests of the padded /
# captured prefill (captured == eager bit for bit incl. staggered arrivals, padded == unpadded on the
# 35B-A3B-shaped NVFP4 model, graphs on == off streams, lossless prefix restore); (B) `bench batched` T_PP with
# prefill graphs on vs off (LINRNN_PREFILL_GRAPHS=0); (C) `bench serve` TTFT / TPOT / tok/s at concurrency 1
# and 64 (in 128 / out 128); (D) one MoE layer per expert path at prefill sizes, for the MMA / grouped-GEMM /
# dequantize thresholds (kernels/moe/experts.py: MMA_MAX_MEAN_PAIRS = 64 pairs per expert, i.e. T <= 2048 at
# top-8 of 256; DEQUANT_MIN_MEAN_PAIRS = 128, T >= 4096). Results under $OUT/prefill.tgz; short tables printed.
# Measured 2026-11-24 (benchmarks/results/prefill_graphs/h200_first_run/): ~290 s.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; R=/tmp/prefill; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# A GPU tests
timeout 200 python3 -m pytest -m gpu tests/test_prefill_graphs.py tests/test_engine_gpu.py tests/test_prefix_gpu.py \
  -n 3 --dist loadfile -q -p no:cacheprovider -rfE --timeout 190 > $R/tests.log 2>&1; echo "rc $?" >> $R/tests.log
el "tests done"; tail -3 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head -12
# B T_PP (and S_TG) with prefill graphs on / off / on (order effects show), one weight load for all three
timeout 200 python3 -m linrnn_serve bench batched --load-format dummy --npp 128,512 --ntg 32 --npl 1,8,64 \
  --config "model=qwen35moe-nvfp4,label=prefill graphs" --config "model=qwen35moe-nvfp4,prefill-graphs=false" \
  --config "model=qwen35moe-nvfp4,label=prefill graphs again" \
  --no-progress --out $R/batched > $R/batched.log 2>&1
el "batched done"; grep -E "^## |^\| (PP|128|512) " $R/batched.md | cut -d'|' -f1-10
# C serving, in 128 / out 128: concurrency 1 and 64 with prefill graphs, concurrency 1 without (TTFT A/B)
serve() {  # $1 label, $2 concurrency list, env before the call
  python3 -m linrnn_serve --model qwen35moe-nvfp4 --load-format dummy --host 127.0.0.1 --port 8014 --max-num-seqs 64 \
    > $R/server_$1.log 2>&1 &
  local S=$!
  for i in $(seq 1 120); do curl -sf 127.0.0.1:8014/health >/dev/null && break; sleep 1; done
  timeout 90 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:8014 --input-len 128 --output-len 128 \
    --max-concurrency $2 --out $R/serve_$1.json > $R/serve_$1.log 2>&1
  kill -INT $S; sleep 3; kill -9 $S 2>/dev/null; wait $S 2>/dev/null
  python3 - $R/serve_$1.json $1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in (d.get("runs", d) if isinstance(d, dict) else d):
    print(f"{sys.argv[2]}: c={r['max_concurrency']} TTFT median {r['ttft_ms']['median']:.1f} ms (p99 "
          f"{r['ttft_ms']['p99']:.1f}), TPOT median {r['tpot_ms']['median']:.2f} ms, out tok/s "
          f"{r.get('output_throughput', r.get('output_token_throughput', float('nan'))):.1f}")
PY
}
serve graphs 1,64
LINRNN_PREFILL_GRAPHS=0 serve eager 1
el "serve done"; grep -iE "captured" $R/server_graphs.log | head -3
# D one MoE layer (35B-A3B shapes, CUDA-graph replays) per path at prefill token counts
timeout 60 python3 -m linrnn_bench.kernels.moe --batch-sizes 128,512,1024,2048,4096 --sets 2 --warmup 10 --rep 40 \
  --variants nvfp4/mma-any,nvfp4/asm,nvfp4/dequant-bf16 > $R/moe.log 2>&1
el "moe done"; grep "^|" $R/moe.log | cut -d'|' -f1-6
tar czf $OUT/prefill.tgz -C /tmp prefill
