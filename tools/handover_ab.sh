#!/usr/bin/env bash
# The API server's hand-over on the CPU, before vs after, back to back (issue #16 "Benefit", #14 TTFT):
#   bash tools/handover_ab.sh BEFORE_REF OUT [ROUNDS]     (run from the repo root, the venv active)
# BEFORE_REF (e.g. a commit) is checked out in a temporary worktree and run as CI and the GPU image have it
# (uvloop and httptools hidden: uvicorn on asyncio + h11), with this tree's measuring tools copied in
# (benchmarks/handover.py, serve_probe.py, http_client.py; its own `bench serve` client is kept: the client
# is part of what is measured). Each round: `python -m linrnn_bench.handover run` before, then after
# (32 users x 8 turns, 2048-token shared system prompt, H200-paced stub), then
# `python -m linrnn_bench.host_overhead --batch 1,128` before, then after. Writes OUT/handover.md (every
# round side by side), OUT/host_overhead.md and the runs' files.
set -e
REF=${1:?BEFORE_REF}; OUT=${2:?OUT}; ROUNDS=${3:-2}
ROOT=$(pwd); OUT=$(realpath -m "$OUT"); mkdir -p "$OUT"
TMP=$(mktemp -d); BEFORE=$TMP/before; SITE=$TMP/site
git worktree add --detach "$BEFORE" "$REF" >/dev/null
trap 'git -C "$ROOT" worktree remove --force "$BEFORE"; rm -rf "$TMP"' EXIT
cp benchmarks/handover.py benchmarks/serve_probe.py benchmarks/http_client.py "$BEFORE/benchmarks/"
mkdir -p "$SITE"
for pair in linrnn_serve:linrnn_serve linrnn_kernels:kernels linrnn_server:server linrnn_bench:benchmarks; do
  ln -sfn "$BEFORE/${pair#*:}" "$SITE/${pair%%:*}"
done
printf 'import sys\nsys.modules["uvloop"] = None\nsys.modules["httptools"] = None\n' > "$SITE/sitecustomize.py"
before() { (cd "$BEFORE" && PYTHONPATH=$SITE "$@"); }
labels=()
for r in $(seq 1 "$ROUNDS"); do
  before python -m linrnn_bench.handover run --out "$OUT" --label "before_$r" > /dev/null
  python -m linrnn_bench.handover run --out "$OUT" --label "after_$r" > /dev/null
  labels+=("before_$r" "after_$r")
  before python -m linrnn_bench.host_overhead --batch 1,128 --out "$OUT/host_overhead_before_$r" > /dev/null 2>&1
  python -m linrnn_bench.host_overhead --batch 1,128 --out "$OUT/host_overhead_after_$r" > /dev/null 2>&1
done
python -m linrnn_bench.handover report "$OUT" "${labels[@]}" | tee "$OUT/handover.md"
python - "$OUT" "${labels[@]}" <<'PY' | tee "$OUT/host_overhead.md"
import json, sys
out, labels = sys.argv[1], sys.argv[2:]
print("| run | B | bare ms/step mean / median | served ms/step mean / median |\n|---|---:|---:|---:|")
for label in labels:
    for row in json.load(open(f"{out}/host_overhead_{label}/host_overhead.json"))["rows"]:
        b, s = row["bare"], row["served"]
        print(f"| {label} | {row['batch']} | {b['mean_ms']:.3f} / {b['median_ms']:.3f} | "
              f"{s['mean_ms']:.3f} / {s['median_ms']:.3f} |")
PY
