#!/usr/bin/env bash
# Host time per decode step, before vs after, interleaved (issue #14's CPU benchmark line):
#   bash tools/host_ab.sh BEFORE_REF OUT [ROUNDS] [TOKENS]     (run from the repo root, the venv active)
# BEFORE_REF (e.g. a commit) is exported (git archive) to a temporary folder and run from there with the same
# interpreter and packages (PYTHONPATH puts its packages first). Each round: `python -m linrnn_bench.host_overhead
# --batch 1,128 --tokens TOKENS` (default 1024: the 128 requests reach the core over tens of ms, so shorter
# requests may never all run at once) before, then after (bare and served, OMP_NUM_THREADS=1 as on the GPU
# machine), then tools/host_phases.py before and after (the B = 128 step split into its phases). Writes OUT/host_ab.md
# (every run, the median over rounds of each column, the phases) and the runs' JSON files.
set -e
REF=${1:?BEFORE_REF}; OUT=${2:?OUT}; ROUNDS=${3:-3}; TOKENS=${4:-1024}
ROOT=$(pwd); OUT=$(realpath -m "$OUT"); mkdir -p "$OUT"
TMP=$(mktemp -d); BEFORE=$TMP/before; SITE=$TMP/site
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$BEFORE" "$SITE"
git archive "$REF" | tar -x -C "$BEFORE"
for pair in linrnn_serve:linrnn_serve linrnn_kernels:kernels linrnn_server:server linrnn_bench:benchmarks; do
  ln -sfn "$BEFORE/${pair#*:}" "$SITE/${pair%%:*}"
done
export OMP_NUM_THREADS=1
run() { python -m linrnn_bench.host_overhead --batch 1,128 --tokens "$TOKENS" --out "$@" > /dev/null 2>&1; }
labels=()
for r in $(seq 1 "$ROUNDS"); do
  (cd "$BEFORE" && PYTHONPATH=$SITE run "$OUT/before_$r")
  run "$OUT/after_$r"
  (cd "$BEFORE" && PYTHONPATH=$SITE python "$ROOT/tools/host_phases.py" > "$OUT/phases_before_$r.json" 2> /dev/null)
  python tools/host_phases.py > "$OUT/phases_after_$r.json" 2> /dev/null
  labels+=("before_$r" "after_$r")
  echo "round $r done (load $(cut -d' ' -f1 /proc/loadavg))"
done
python - "$OUT" "$REF" "$(git rev-parse --short HEAD)" "${labels[@]}" <<'PY' | tee "$OUT/host_ab.md"
import json, os, statistics, sys
out, ref, head, labels = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
runs = {l: json.load(open(f"{out}/{l}/host_overhead.json")) for l in labels}
env = runs[labels[0]]["env"]
print(f"# Host time per decode step, stubbed forward: before ({ref}) vs after ({head})\n")
print(f"`bash tools/host_ab.sh {ref} OUT {len(labels) // 2} {env['tokens']}`, {env['date']}, {env['cores']} cores "
      f"({env['cpu']}), python {env['python']}, torch {env['torch']}, OMP_NUM_THREADS=1, tokens {env['tokens']}\n")
print("| run | 1-min load | B | bare ms/step mean / median | served ms/step mean / median (mean batch) | served, "
      "steps at B only: mean / median (steps) |\n|---|---:|---:|---:|---:|---:|")
for l in labels:
    for row in runs[l]["rows"]:
        b, s = row["bare"], row["served"]
        full = f"{s['full_mean_ms']:.3f} / {s['full_median_ms']:.3f} ({s['full_steps']})" if "full_steps" in s \
            else "not measured by that tree"
        print(f"| {l} | {runs[l]['env']['load_avg_1m']:.1f} | {row['batch']} | {b['mean_ms']:.3f} / {b['median_ms']:.3f} | "
              f"{s['mean_ms']:.3f} / {s['median_ms']:.3f} ({s['mean_batch']:.0f}) | {full} |")
print("\nMedian over the rounds:\n\n| B | bare mean before -> after | bare median before -> after | served mean before -> after "
      "| served median before -> after |\n|---:|---:|---:|---:|---:|")
for i, row in enumerate(runs[labels[0]]["rows"]):
    def med(side, kind, key):
        return statistics.median(runs[l]["rows"][i][kind][key] for l in labels if l.startswith(side))
    cells = [f"{med('before', k, m):.3f} -> {med('after', k, m):.3f}" for k in ("bare", "served")
             for m in ("mean_ms", "median_ms")]
    print(f"| {row['batch']} | " + " | ".join(cells) + " |")
phases = {l: json.load(open(f"{out}/phases_{l}.json")) for l in labels}
names = list(phases[labels[0]])
print("\nThe B = 128 step's phases (tools/host_phases.py: ms, median over 800 steps; then the median over rounds):\n")
print("| run | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
for l in labels:
    print(f"| {l} | " + " | ".join(f"{phases[l][k]:.4f}" for k in names) + " |")
for side in ("before", "after"):
    print(f"| **{side}** | " + " | ".join(
        f"**{statistics.median(phases[l][k] for l in labels if l.startswith(side)):.4f}**" for k in names) + " |")
PY
