#!/usr/bin/env bash
# Issue #16's benefit line in ONE device call (H200, ~4 min from a cold machine): TTFT p50 over turns 2-8 with
# prefix caching on vs off, both with --mixed-batch and late binding on (the default), then the on run again with
# --no-late-binding (the late-binding A/B) if time is left. Pass LINRNN_COMMIT=<sha>; BUDGET=<s> (default 280).
#   1. gpu_prefix.sh on  (traced server: tools/prefix_timeline.py's TTFT breakdown per turn, one turn's steps)
#   2. gpu_prefix.sh off
#   3. gpu_prefix.sh report on off   (per-turn table, off / on ratio, output tok/s, hit rate)
#   4. gpu_prefix.sh on on_early --no-late-binding (traced), report on_early off
# Each run's server on its own port, stopped by gpu_prefix.sh itself (no outer timeout that would leave it up).
# $OUT/ttft.tgz (every file) and $OUT/ttft_report.md are rewritten after each stage (a cut-off call keeps them).
. tools/device_env.sh >/dev/null
OUT=${OUT:-/tmp/out}; W=/tmp/ttft; rm -rf $W; mkdir -p $W $OUT
BUDGET=${BUDGET:-280}; T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
save() { echo "($1 at $(( $(date +%s) - T0 )) s)" >> $W/report.md; cp $W/report.md $OUT/ttft_report.md
         tar czf $OUT/ttft.tgz -C /tmp ttft; }
echo "commit ${LINRNN_COMMIT:-unknown}, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee $W/report.md
OUT=$W TRACE=1 PORT=8021 bash tools/gpu_prefix.sh on on --mixed-batch > /dev/null
save "on done"
OUT=$W PORT=8022 bash tools/gpu_prefix.sh off off --mixed-batch > /dev/null
{ echo; echo "## caching on vs off, --mixed-batch, late binding on (the acceptance pair)"; } >> $W/report.md
OUT=$W bash tools/gpu_prefix.sh report on off >> $W/report.md
for l in on off; do
  echo "$l: $(grep -E 'ready in' $W/prefix_server_$l.log | tail -1 | sed 's/.*\[core\]: //')" >> $W/report.md
  grep -E 'late binding:' $W/prefix_server_$l.log | sed "s/.*\[core\]: /$l: /" >> $W/report.md
done
{ echo; echo "## the on run's TTFT breakdown"; cat $W/prefix_timeline_on.md; } >> $W/report.md
save "off done"
if [ "$(left)" -ge 70 ]; then
  OUT=$W TRACE=1 PORT=8023 bash tools/gpu_prefix.sh on on_early --mixed-batch --no-late-binding > /dev/null
  { echo; echo "## late binding off (--no-late-binding), same call"; } >> $W/report.md
  OUT=$W bash tools/gpu_prefix.sh report on_early off >> $W/report.md
  grep -E '^Turns 2' $W/prefix_timeline_on_early.md >> $W/report.md
  save "on_early done"
else
  echo "no time left for the --no-late-binding run ($(left) s)" >> $W/report.md
fi
rm -f $W/prefix_report.md
save "total"
cat $OUT/ttft_report.md
