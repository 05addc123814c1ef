#!/usr/bin/env bash
# Issue #16's benefit line in ONE device call (H200, ~4-5 min): TTFT p50 over turns 2-8 with prefix caching on
# vs off, both with --mixed-batch, late binding on (the default), then the on run again with --no-late-binding
# (the late-binding A/B) if time is left. Pass LINRNN_COMMIT=<sha>; BUDGET=<s> (default 280) bounds the call.
#   1. gpu_prefix.sh on  (traced server: tools/prefix_timeline.py's TTFT breakdown per turn, one turn's steps)
#   2. gpu_prefix.sh off
#   3. gpu_prefix.sh report on off   (per-turn table, off / on ratio, output tok/s, hit rate)
#   4. gpu_prefix.sh on on_early --no-late-binding, report on_early off
# Everything lands in $OUT/ttft.tgz plus $OUT/ttft_report.md (the device returns few files).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=/tmp/ttft; rm -rf $W; mkdir -p $W $OUT
BUDGET=${BUDGET:-280}; T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
OUT=$W TRACE=1 timeout 110 bash tools/gpu_prefix.sh on on --mixed-batch
echo "on done at $(( $(date +%s) - T0 )) s" | tee -a $W/report.md
OUT=$W timeout 110 bash tools/gpu_prefix.sh off off --mixed-batch
echo "off done at $(( $(date +%s) - T0 )) s" | tee -a $W/report.md
{ echo; echo "## caching on vs off, --mixed-batch, late binding on (the acceptance pair)"; } >> $W/report.md
OUT=$W bash tools/gpu_prefix.sh report on off >> $W/report.md
for l in on off; do echo "$l: $(grep -E "ready in" $W/prefix_server_$l.log | tail -1)" >> $W/report.md; done
{ echo; echo "## the on run's TTFT breakdown"; cat $W/prefix_timeline_on.md; } >> $W/report.md
if [ "$(left)" -ge 75 ]; then
  OUT=$W timeout $(( $(left) - 5 )) bash tools/gpu_prefix.sh on on_early --mixed-batch --no-late-binding
  { echo; echo "## late binding off (--no-late-binding), same call"; } >> $W/report.md
  OUT=$W bash tools/gpu_prefix.sh report on_early off >> $W/report.md
else
  echo "no time left for the --no-late-binding run ($(left) s)" >> $W/report.md
fi
echo "total $(( $(date +%s) - T0 )) s" >> $W/report.md
rm -f $W/prefix_report.md
cp $W/report.md $OUT/ttft_report.md
tar czf $OUT/ttft.tgz -C /tmp ttft
cat $OUT/ttft_report.md
