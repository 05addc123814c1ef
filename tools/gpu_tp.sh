#!/usr/bin/env bash
# Multi-GPU acceptance of tensor / expert parallelism (issue 19). Run on nvidia-h200-x2 (steps 1-4)
# or nvidia-h200-x4 (adds step 5: 397B-A17B at TP 4). Prints short tables; results under $OUT.
#   1. NCCL all-reduce bus bandwidth between the GPUs (tools/nccl_probe.py, as nccl-tests' busbw)
#   2. 35B-A3B NVFP4 dummy: greedy streams of 8 fixed prompts x 32 tokens at TP 2 and EP 2 vs TP 1,
#      logits relative error (bf16 tolerance) while the streams agree (tools/tp_compare.py)
#   3. bench batched S_TG at npl 1..128 for TP 1 / TP 2 / EP 2, with the per-step communication time
#      and the all-reduce bandwidth beside step 1's bus bandwidth
#   4. 122B-A10B NVFP4 dummy served at TP 2: health, a completion, a short serving benchmark
#   5. (4 GPUs) 397B-A17B NVFP4 dummy served at TP 4 and EP 4, same checks
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== $NGPU GPUs"; nvidia-smi topo -m 2>/dev/null | head -6
if [ "$NGPU" -lt 2 ]; then echo "needs 2 or more GPUs: blocked"; exit 2; fi

echo "== 1. all-reduce bus bandwidth"
timeout 300 python3 -m tools.nccl_probe --ranks 2 --out "$OUT/nccl_probe_2.json" | tee "$OUT/nccl_probe.txt"
[ "$NGPU" -ge 4 ] && timeout 300 python3 -m tools.nccl_probe --ranks 4 --out "$OUT/nccl_probe_4.json" \
  | tee -a "$OUT/nccl_probe.txt"

echo "== 2. greedy streams TP2 / EP2 vs TP1 (35B-A3B NVFP4 dummy)"
timeout 1500 python3 -m tools.tp_compare --model qwen35moe-nvfp4 --load-format dummy --configs tp1,tp2,ep2 \
  --num-prompts 8 --max-tokens 32 --out "$OUT/tp_compare" 2>&1 | grep -E "^\||FAILED|Error" | tee "$OUT/tp_compare.txt"

echo "== 3. bench batched TP1 / TP2 / EP2 (35B-A3B NVFP4 dummy)"
M="model=qwen35moe-nvfp4,load-format=dummy"
timeout 2400 python3 -m linrnn_serve bench batched --npp 128 --ntg 128 --npl 1,8,32,64,128 --vllm-ref --no-progress \
  --config "$M,label=TP1" --config "$M,tp=2,label=TP2" --config "$M,tp=2,ep=true,label=EP2" \
  --out "$OUT/batched_tp" 2>&1 | grep -E "^\||^## |^Comm|FAILED" | tee "$OUT/batched_tp.txt"

serve_check() {  # name tp extra-flags...: start, health, one completion, a short serving benchmark, stop
  local model=$1 tp=$2; shift 2
  python3 -m linrnn_serve --model "$model" --load-format dummy -tp "$tp" "$@" --host 127.0.0.1 --port 8019 \
    --max-num-seqs 64 > "$OUT/server_${model}_tp${tp}.log" 2>&1 &
  local srv=$!
  for i in $(seq 1 900); do curl -sf 127.0.0.1:8019/health >/dev/null && break; kill -0 $srv 2>/dev/null || break; sleep 1; done
  curl -sS 127.0.0.1:8019/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"Hello\", \"max_tokens\": 16, \"temperature\": 0}" | head -c 400; echo
  timeout 600 python3 -m linrnn_serve bench serve --base-url http://127.0.0.1:8019 --input-len 128 --output-len 128 \
    --max-concurrency 1,32,64 --out "$OUT/serve_${model}_tp${tp}.json" 2>&1 | grep "^|"
  grep -E "tensor parallel|caches:|weights" "$OUT/server_${model}_tp${tp}.log" | head -5
  kill -INT $srv; wait $srv; echo "server exit status $?"
}

echo "== 4. 122B-A10B NVFP4 dummy at TP 2"
serve_check qwen35moe-122b-nvfp4 2

if [ "$NGPU" -ge 4 ]; then
  echo "== 5. 397B-A17B NVFP4 dummy at TP 4 and EP 4"
  serve_check qwen35moe-397b-nvfp4 4
  serve_check qwen35moe-397b-nvfp4 4 --enable-expert-parallel
else
  echo "== 5. 397B-A17B at TP 4: skipped ($NGPU GPUs)"
fi
tar czf "$OUT/gpu_tp.tgz" -C "$OUT" --exclude gpu_tp.tgz . 2>/dev/null
