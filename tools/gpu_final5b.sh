#!/usr/bin/env bash
# Lead's third final call of session 5 (one H200, <= 10 min): gpu_sched.sh (#16 benefit on / off with the TTFT
# breakdown, #14 bench serve c = 64), then the NVFP4 MMA kernel round 3 (this tree) vs round 2 (594aba5's
# kernels/moe files, kept in benchmarks/results/final_run_5/mma_round2_overlay/) in the engine: bench batched
# npl 1, 8, 128, one after the other in this call. Results under $OUT.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; R=/tmp/final5b; mkdir -p $R $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
OUT=$OUT bash tools/gpu_sched.sh > $R/sched.log 2>&1; el "sched"; tail -22 $R/sched.log
BB="python3 -m linrnn_serve bench batched --model qwen35moe-nvfp4 --load-format dummy --npp 128 --ntg 64 --npl 1,8,128 --no-progress"
timeout 110 $BB --out $R/round3 > $R/round3.log 2>&1; el "round3"; grep -E "^\| 128 " $R/round3/batched.md
for f in experts nvfp4_layout nvfp4_mma nvfp4_wgmma; do
  cp benchmarks/results/final_run_5/mma_round2_overlay/$f.py.txt kernels/moe/$f.py
done
timeout 110 $BB --out $R/round2 > $R/round2.log 2>&1; el "round2"; grep -E "^\| 128 " $R/round2/batched.md
tar czf $OUT/final5b.tgz -C /tmp final5b
