#!/usr/bin/env bash
# Prefill kernels round 3 (H3), one H200 call; pass LINRNN_COMMIT=<sha>; timeout_s 240.
# MODE=probe (the first call):
#   A. tools/prefill_probe.py --shapes 64x128,16x129@3072: one prefill forward of #14's c = 64 wave (64 fresh
#      128-token prompts) and of #16's prefix-cache burst (16 x 129-token continuations after 3072 cached
#      tokens): wall / host / kernel ms, kernel ms per component against its floor, top kernels, graph replay
#   (if present: tools/gdn_ablate.py, timing-only ablations of the wy / state kernels, from the .gpu overlay)
#   B. tools/gdn_prefill_sweep.py: the GDN chunk kernels' launch configs (per-kernel us) at 64x128 / 16x129
# MODE=ab (the second call; BEFORE=DIR: main's copies of the files this round changed, at their paths, as
#   tools/prefill_ab_before.sh makes them; STAGES picks stages, default "tests ab sweep"):
#   A. the GPU tests of the kernels this round touched (GDN prefill configs / fused output / bf16 shapes, conv,
#      attention)
#   B. tools/prefill_ab.py --before $BEFORE: probe per component and bench batched's S_PP row (npl 64, 128;
#      PP 128) before / after, alternating on one engine
#   C. tools/prefill_kernel_sweep.py: GDN / conv / attention launch configs
# Every stage has its own timeout; $OUT/report.md, JSON and logs beside it.
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=$OUT; mkdir -p $W
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
probe() {  # $1 label, $2 timeout, then extra flags
  local label=$1 t=$2; shift 2
  timeout $t python3 tools/prefill_probe.py --shapes ${SHAPES:-64x128,16x129@3072} --json $W/probe_$label.json "$@" \
    > $W/probe_$label.log 2>&1
  echo "[$SECONDS s] probe $label: rc $?" | tee -a $W/report.md
  grep -v "^\[" $W/probe_$label.log | grep -E "^\||^device|^\{" | cut -c1-200 >> $W/report.md
}
sweep() {
  timeout $1 python3 tools/prefill_kernel_sweep.py --json $W/sweep.json > $W/sweep.log 2>&1
  echo "[$SECONDS s] sweep: rc $?" | tee -a $W/report.md
  grep -E "^\||vs naive|Error" $W/sweep.log >> $W/report.md
}
if [ "${MODE:-probe}" = probe ]; then
  probe main ${TA:-115}
  if [ -f tools/gdn_ablate.py ]; then
    timeout ${TB:-40} python3 tools/gdn_ablate.py > $W/ablate.log 2>&1; echo "[$SECONDS s] ablate: rc $?" | tee -a $W/report.md
    grep "^|" $W/ablate.log >> $W/report.md
  fi
  sweep $(( ${BUDGET:-232} - SECONDS ))
fi
STAGES=${STAGES:-tests ab sweep}
if [ "${MODE:-probe}" = ab ] && [[ $STAGES == *tests* ]]; then
  timeout ${TA:-65} python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/test_gdn_kernels.py tests/test_attention_kernels.py \
    -k "gpu_prefill_configs or gpu_prefill_output_tile or gpu_conv or attention" \
    > $W/tests.log 2>&1
  echo "[$SECONDS s] GPU tests: rc $?" | tee -a $W/report.md
  grep -E "passed|failed|FAILED|Error" $W/tests.log | tail -15 >> $W/report.md
fi
if [ "${MODE:-probe}" = ab ] && [[ $STAGES == *ab* ]]; then
  timeout ${TB:-105} python3 tools/prefill_ab.py --before ${BEFORE:?} --json $W/ab.json > $W/ab.log 2>&1
  echo "[$SECONDS s] A/B: rc $?" | tee -a $W/report.md
  grep -E "^\||^device|^round" $W/ab.log >> $W/report.md
fi
if [ "${MODE:-probe}" = ab ] && [[ $STAGES == *sweep* ]]; then
  sweep $(( ${BUDGET:-232} - SECONDS ))
fi
cat $W/report.md
