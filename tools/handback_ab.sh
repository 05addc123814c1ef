#!/usr/bin/env bash
# The hand-back of a c = 64 wave on the CPU, before vs after, back to back (issue #14, the c = 64 line):
#   bash tools/handback_ab.sh BEFORE_REF OUT [ROUNDS]     (run from the repo root, the venv active)
# BEFORE_REF (e.g. a commit) is checked out in a temporary worktree, with this tree's measuring tools copied in
# (benchmarks/wave.py, handover.py, serve_probe.py, server_cpu.py; its own `bench serve` client is kept: the
# client is part of what is measured). Each round, before then after: `python -m linrnn_bench.wave run` at c = 64
# (256 prompts, in 128 / out 128, the H200-paced stub), the same at c = 1 (8 prompts: the TTFT of a lone request),
# and `python -m linrnn_bench.server_cpu`. Writes OUT/wave.md, OUT/wave_c1.md, OUT/server_cpu.md and the runs'
# files (traces: `python -m linrnn_bench.wave timeline OUT/trace_LABEL`).
set -e
REF=${1:?BEFORE_REF}; OUT=${2:?OUT}; ROUNDS=${3:-2}
ROOT=$(pwd); OUT=$(realpath -m "$OUT"); mkdir -p "$OUT"
TMP=$(mktemp -d); BEFORE=$TMP/before; SITE=$TMP/site
git worktree add --detach "$BEFORE" "$REF" >/dev/null
trap 'git -C "$ROOT" worktree remove --force "$BEFORE"; rm -rf "$TMP"' EXIT
cp benchmarks/wave.py benchmarks/handover.py benchmarks/serve_probe.py benchmarks/server_cpu.py "$BEFORE/benchmarks/"
mkdir -p "$SITE"
for pair in linrnn_serve:linrnn_serve linrnn_kernels:kernels linrnn_server:server linrnn_bench:benchmarks; do
  ln -sfn "$BEFORE/${pair#*:}" "$SITE/${pair%%:*}"
done
before() { (cd "$BEFORE" && PYTHONPATH=$SITE "$@"); }
labels=(); c1=()
for r in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    run=(); [ "$side" = before ] && run=(before)
    "${run[@]}" python -m linrnn_bench.wave run --out "$OUT" --label "${side}_$r" > /dev/null
    "${run[@]}" python -m linrnn_bench.wave run --out "$OUT" --label "c1_${side}_$r" --concurrency 1 --num-prompts 8 \
      > /dev/null
    "${run[@]}" python -m linrnn_bench.server_cpu --label "${side}_$r" --out "$OUT/server_cpu_${side}_$r.json" \
      > /dev/null
  done
  labels+=("before_$r" "after_$r"); c1+=("c1_before_$r" "c1_after_$r")
done
python -m linrnn_bench.wave report "$OUT" "${labels[@]}" | tee "$OUT/wave.md"
python -m linrnn_bench.wave report "$OUT" "${c1[@]}" | tee "$OUT/wave_c1.md"
python - "$OUT" "${labels[@]}" <<'PY' | tee "$OUT/server_cpu.md"
import json, sys
out, labels = sys.argv[1], sys.argv[2:]
runs = [json.load(open(f"{out}/server_cpu_{label}.json")) for label in labels]
print("| API server CPU ms per 64 requests (min / median of 30) | " + " | ".join(labels) + " |")
print("|---|" + "---:|" * len(runs))
for p in ("intake", "first", "token", "finish"):
    print(f"| {p} | " + " | ".join(f"{r['cpu'][p]['min_ms']:.2f} / {r['cpu'][p]['median_ms']:.2f}" for r in runs) + " |")
print("| ASGI body messages per finished stream | " + " | ".join(f"{r['body_messages_per_finished_stream']:.0f}"
                                                                for r in runs) + " |")
print("| commit | " + " | ".join(r["commit"] for r in runs) + " |")
PY
