#!/usr/bin/env bash
# Small-batch decode (issue #15), one device call of ~9 minutes (repo root as cwd). Stages (default all):
#   tests    the kernel test files of this work compiled on CUDA (skinny GEMM, fused router, conv / norm / RoPE+KV
#            epilogues, the model-level decode step vs the reference ops), gpu-marked full shapes
#   gemv     the `gemv` registry entry: its GPU tests, then skinny GEMM vs cuBLAS over the 35B-A3B dense shapes at
#            M in 1,2,4,8,16,32 -> gemv.md + skinny_table.json (per-shape max_m: where skinny beats cuBLAS)
#   batched  bench batched, 35B-A3B NVFP4 dummy, f32 state, npl 1 and 8 (+ profile at npl 1 and 8 with launches/step):
#            fused kernels with the measured table, then LINRNN_SKINNY_GEMM=0 LINRNN_FUSED_ROUTER=0 LINRNN_FUSED_ROPE_KV=0 (the old
#            kernels) in the same call, then the fused kernels with LINRNN_PDL=1
#   gdn      the gdn-decode registry entry (all-f32 / all-bf16 / hybrid % of copy)
# Prints one short table at the end; everything lands in $OUT/small.tgz.
#   bash tools/gpu_small.sh [tests,gemv,batched,gdn]
. tools/device_env.sh >/dev/null
STAGES=${1:-tests,gemv,batched,gdn}
FINAL=${OUT:-/tmp/out}
R=/tmp/small
mkdir -p $R $FINAL
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if has tests; then
  timeout 200 python3 -m pytest tests/test_gemv_kernels.py tests/test_fused_decode.py tests/test_norm_kernels.py -q -p no:cacheprovider -rfE 2>&1 \
    | tee $R/tests.log | tail -8
fi
if has gemv; then
  timeout 200 python3 -m linrnn_serve bench kernels --only gemv --timeout-factor 1.5 --results-dir $R/k 2>&1 \
    | grep -vE "Warning|warn" | tail -60
fi
TABLE=$R/k/gemv/skinny_table.json
[ -f "$TABLE" ] && export LINRNN_SKINNY_TABLE=$TABLE
if has batched; then
  B="python3 -m linrnn_serve bench batched --load-format dummy --npp 128 --ntg 64 --npl 1,8 --profile 1,8 --no-progress"
  timeout 110 $B --config 'model=qwen35moe-nvfp4,label=fused' --out $R/b_fused 2>&1 | grep -E "^\| 128|profile:|Error" 
  LINRNN_SKINNY_GEMM=0 LINRNN_FUSED_ROUTER=0 LINRNN_FUSED_ROPE_KV=0 timeout 110 $B --config 'model=qwen35moe-nvfp4,label=unfused' \
    --out $R/b_unfused 2>&1 | grep -E "^\| 128|profile:|Error"
  LINRNN_PDL=1 timeout 110 $B --config 'model=qwen35moe-nvfp4,label=fused+pdl' --out $R/b_pdl 2>&1 \
    | grep -E "^\| 128|profile:|Error"
fi
if has gdn; then
  timeout 130 python3 -m linrnn_serve bench kernels --only gdn-decode --timeout-factor 2 --results-dir $R/k 2>&1 \
    | grep -vE "Warning|warn" | tail -12
fi
python3 - "$R" <<'PY'
import glob, json, os, sys
r = sys.argv[1]
print("\n== small-batch decode summary ==")
g = os.path.join(r, "k", "gemv", "gemv.json")
if os.path.exists(g):
    d = json.load(open(g))
    print("skinny GEMM vs cuBLAS (speedup by M):")
    shapes = {}
    for row in d["rows"]:
        shapes.setdefault(row["shape"], {})[row["M"]] = row["speedup"]
    for s, by_m in shapes.items():
        print(f"  {s:28s} " + "  ".join(f"M{m}:{v:.2f}x" for m, v in sorted(by_m.items())))
    print("  max_m:", {k: v["max_m"] for k, v in d["table"].items()})
print("| run | npl | ms/step | launches/step (profile) |\n|---|---:|---:|---:|")
for label in ("fused", "unfused", "pdl"):
    f = os.path.join(r, f"b_{label}", "batched.json")
    if not os.path.exists(f):
        continue
    d = json.load(open(f))
    for c in d["configs"]:
        prof = {p["B"]: p for p in c.get("profile", [])}
        for row in c["rows"]:
            B = row.get("B") or row.get("npl")
            ms = row.get("ms_per_step") or row.get("ms/step")
            p = prof.get(B, {})
            print(f"| {label} | {B} | {ms} | {p.get('launches_per_step', '-')} |")
PY
tar czf $FINAL/small.tgz -C /tmp small
