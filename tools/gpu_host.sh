#!/usr/bin/env bash
# Host time per decode step on the GPU machine's CPU (issue #14's CPU benchmark line: <= 0.5 ms at B = 128 with
# the API server attached and 128 streaming clients). `python -m linrnn_bench.host_overhead` with the GPU hidden
# (CUDA_VISIBLE_DEVICES=, stubbed forward) and OMP_NUM_THREADS=1, as benchmarks/results/host_overhead/
# gpu_host_16core/README.md ran it, but 1024 tokens per request (with 256 the 128 requests, which reach the core
# over tens of ms, hardly all run at once any more): three repeats of B = 1 and 128, bare and served; prints one
# table (each repeat's mean / median and the median over repeats), then tools/host_phases.py (the B = 128 step split
# into its phases); all in $OUT/gpu_host.md. About 60-100 s on an idle 16-core machine (one repeat ~20 s; no
# repeat starts after 70 s; on this project's loaded 2-core box one repeat took over 60 s).
#   bash tools/gpu_host.sh          (LINRNN_COMMIT=<sha> names the tree in the table)
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nproc; uptime
for r in 1 2 3; do
  [ $r -gt 1 ] && [ $(( $(date +%s) - T0 )) -gt 70 ] && { el "no time for repeat $r"; break; }
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 90 python3 -m linrnn_bench.host_overhead --batch 1,128 --tokens 1024 \
    --out $OUT/host_overhead_r$r > $OUT/host_overhead_r$r.log 2>&1
  el "repeat $r (rc $?)"; grep "^B=" $OUT/host_overhead_r$r.log
done
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 40 python3 tools/host_phases.py > $OUT/phases.json 2> $OUT/phases.log
el "phases (rc $?)"
python3 - $OUT "${LINRNN_COMMIT:-unknown}" <<'PY' | tee $OUT/gpu_host.md
import json, os, statistics, sys
out, commit = sys.argv[1], sys.argv[2]
runs = []
for r in (1, 2, 3):
    try:
        runs.append(json.load(open(f"{out}/host_overhead_r{r}/host_overhead.json")))
    except Exception as e:
        print(f"repeat {r} missing: {e}")
if runs:
    env = runs[0]["env"]
    print(f"# Host time per decode step, stubbed forward, GPU machine CPU ({env['cores']} cores, "
          f"load {env['load_avg_1m']:.1f}), tree {commit}, {env['date']}, {len(runs)} repeats\n")
    print("| B | bare mean / median per repeat | bare mean (median of repeats) | served at B: mean / median (steps) "
          "per repeat | served at B: mean, median (medians of repeats) | served, all decode steps: mean / median "
          "(mean batch) per repeat |\n|---|---|---|---|---|---|")
    for i, row in enumerate(runs[0]["rows"]):
        rows = [run["rows"][i] for run in runs]
        b = " ; ".join(f"{x['bare']['mean_ms']:.3f} / {x['bare']['median_ms']:.3f}" for x in rows)
        f = " ; ".join(f"{x['served']['full_mean_ms']:.3f} / {x['served']['full_median_ms']:.3f} "
                       f"({x['served']['full_steps']})" for x in rows)
        s = " ; ".join(f"{x['served']['mean_ms']:.3f} / {x['served']['median_ms']:.3f} "
                       f"({x['served']['mean_batch']:.0f})" for x in rows)
        med = lambda k, m: statistics.median(x[k][m] for x in rows)
        print(f"| {row['batch']} | {b} | {med('bare', 'mean_ms'):.3f} | {f} | {med('served', 'full_mean_ms'):.3f}, "
              f"{med('served', 'full_median_ms'):.3f} | {s} |")
    print("\nIssue #14's bar: served <= 0.5 ms/step at B = 128 (the 'served at B' columns: steps with all 128 "
          "streams running).")
try:
    ph = json.load(open(f"{out}/phases.json"))
    print("\nB = 128 step phases (tools/host_phases.py, median ms): " + ", ".join(f"{k} {v:.4f}" for k, v in ph.items()))
except Exception as e:
    print("phases missing:", e)
PY
el "done"
