#!/usr/bin/env bash
# Issue #18 on a GPU (repo root as cwd; logs under $OUT): the weights-fit check before building a model.
#  1. the estimate (a build on the meta device) against the bytes really allocated by the loaded model,
#     for qwen35moe-nvfp4 (dummy weights, bf16): prints estimate, actual, ratio (expect 1.00);
#  2. `linrnn-serve --model qwen35moe-bf16 --load-format dummy --gpu-memory-utilization 0.2` must refuse
#     within 60 s with exit status 1 and a "needs ... GiB ... usable" line (no model built).
. tools/device_env.sh
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - <<'PY' 2>&1 | tee "$OUT/harden_weight_estimate.log" | tail -5
import torch
from linrnn_serve.presets import resolve_model
from linrnn_serve.models.loading import load_model, weight_bytes
r = resolve_model("qwen35moe-nvfp4", "dummy")
est = weight_bytes(r.cfg, torch.bfloat16)
base = torch.cuda.memory_allocated()
m = load_model(r.cfg, None, torch.bfloat16, torch.device("cuda"), "dummy", progress=False)
torch.cuda.synchronize()
got = torch.cuda.memory_allocated() - base
print(f"| model | estimate GiB | allocated GiB | ratio |\n|---|---:|---:|---:|\n"
      f"| qwen35moe-nvfp4 bf16 | {est / 2**30:.2f} | {got / 2**30:.2f} | {got / est:.3f} |")
PY
start=$(date +%s)
timeout 120 linrnn-serve --model qwen35moe-bf16 --load-format dummy --gpu-memory-utilization 0.2 --port 0 \
  > "$OUT/harden_refusal.log" 2>&1
rc=$?
echo "refusal: exit $rc after $(( $(date +%s) - start )) s (want 1, < 60 s)"
grep -m1 "cannot start the engine" "$OUT/harden_refusal.log"
