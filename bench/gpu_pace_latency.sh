#!/usr/bin/env bash
# Issues 25 and 26's open questions on the H200, each part one device call of at most ~9 min (each step has its
# timeout; a run cut short keeps its JSON); results and logs into $OUT, else bench/out:
#   bash bench/gpu_pace_latency.sh pace       1. + 3.
#   bash bench/gpu_pace_latency.sh latency    2.
#   bash bench/gpu_pace_latency.sh events     4.
#   bash bench/gpu_pace_latency.sh host       5.
#   bash bench/gpu_pace_latency.sh class      6.
#   bash bench/gpu_pace_latency.sh chunk      7.
#   bash bench/gpu_pace_latency.sh wait       8.
#   bash bench/gpu_pace_latency.sh depth      9.
#   bash bench/gpu_pace_latency.sh final      10.
#   bash bench/gpu_pace_latency.sh marks      11.
#   bash bench/gpu_pace_latency.sh paced      12.
#   bash bench/gpu_pace_latency.sh now        13.
#   bash bench/gpu_pace_latency.sh slack      14.
#   bash bench/gpu_pace_latency.sh budget     15.
# 1. Where the small-kernel loop's time goes at caps 50 / 70 (45 / 63 % judged in one process, 2026-12-03):
#    bench/turn_pace.py for the small loop and the training step with more rounds, then again with the trace build
#    (each phase's gate refusals, drains, true-ups owed, window starts: bench/shim_trace.py); then
#    bench/turn_trace.py --profile, the loop alone uncapped, through the agent uncapped, and at 50 and 70.
# 2. What the latency class's event bound costs a host-bound training neighbour and gives a request beside it:
#    bench/latency_gpu.py beside train with the shipped shim (at most 2 long launches queued), a build allowing 4
#    (-DHOLD_EVENT_DEPTH=4) and one without the bound (-DHOLD_EVENT_MIN_NS=UINT64_MAX); each pair run records the
#    neighbour's held-back time and count.
# 3. bench/launch_overhead.py: the metered path in process and across processes, judged.
# 4. What the meter's event calls cost (each ~3.3 us on the H200 VM): launch overhead and turn_pace (train, small,
#    mm-sync at caps 30 / 70) with a build that polls a sample only once it is due (-DPOLL_WHEN_DUE=1: 9x fewer
#    queries behind a deep queue on the simulated driver, the same samples) and one with 4x fewer samples and
#    fences (-DSAMPLE_EVERY=1024u -DFENCE_EVERY=1024u -DPOLL_EVERY_MASK=31u), beside the shipped shim.
# 5. Whether a host-bound program's pace in its windows is lost to its thread's sleep between windows (the pace
#    call of 2026-12-04 found no wait in the shim while the small loop ran at 75-83 % of its lent pace, its launch
#    calls slower): pace_probe and turn_pace with builds that spin the whole wait (-DWAKE_EARLY_NS=1000000000ull)
#    or its last 2 ms (-DWAKE_EARLY_NS=2000000ull) instead of the last 0.1 ms.
# 6. The latency class beside train and mm once a neighbour no longer queries an event seen to have run (each
#    short launch asked again), and the launch overhead of the POLL_WHEN_DUE build.
# 7. The latency class beside train and mm, short launches bounded by estimates alone (-DHOLD_CHUNK=0) against
#    by measurement too (-DHOLD_CHUNK=1: an event after each 50 us of their estimated work), two long launches
#    queued in both, so one call weighs the request's wait against the neighbour's pace for both shapes.
# 8. The latency class beside train and mm: a latency container's waits for its result hold its neighbours until
#    they return (-DLAT_WAIT_HOLD=1; short launches bounded by measurement), against a build without the wait
#    (-DLAT_WAIT_HOLD=0) and one without either (-DLAT_WAIT_HOLD=0 -DHOLD_CHUNK=0: the shim of 2026-12-04), two long
#    launches queued in all three; the first also beside an idle latency container.
# 9. Beside matmuls alone (where the wait hold's run of 2026-12-04 fell behind at 500/s): the wait-hold build
#    twice, the build without it, and each with one long launch queued instead of two (-DHOLD_EVENT_DEPTH=1).
# 10. One mark for long and short launches alike (-DHOLD_EVENT_DEPTH=1, no wait hold) in every scenario beside both
#    neighbours, side by side in one run (alone, no Alnair, turns, the latency class strict and elastic, a flood, an
#    idle service); then the latency class beside the training step again with two (-DHOLD_LONG_DEPTH=2).
# 11. The latency class beside both neighbours: the shipped shim (after a long launch the next waits for it, after
#    short ones for the mark before the last), against one mark for both (-DHOLD_EVENT_DEPTH=1) and two for both
#    (-DHOLD_LONG_DEPTH=2), one run.
# 12. The meter's events paced in time (a settled kernel's periodic sample and a fence by count at most once per
#    4 ms per thread): launch_overhead twice each and pace_probe on all five shapes, the shipped shim against the
#    same code unpaced (-DSAMPLE_GAP_NS=0ull -DFENCE_GAP_NS=0ull: every 256 launches, as before 2026-12-04).
# 13. The latency class as shipped, every scenario beside both neighbours side by side in one run.
# 14. A latency flood's GPU time beside matmuls (its cap charged by its estimates): the shipped shim (a sample over
#    both the one before it and the estimate by more than 25 % leaves the estimate), the rule of 2026-12-04 (any
#    sample over the one before it counts as that one: -DLAT_SAMPLE_SLACK_PCT=0ull -DLAT_SAMPLE_VS_ESTIMATE=0) and no
#    such rule (-DLAT_SAMPLE_SLACK_PCT=1000000ull), then the shipped again.
# 15. What the marks cost a neighbour beside a latency stream at 500/s (train and mm, strict and elastic): the shipped
#    shim against short launches' marks spaced out while each asked about had run (-DHOLD_CHUNK_MAX_NS=200000ull)
#    and against a queue bounded by work instead of by marks (-DHOLD_QUEUE_WORK_NS=150000ull: the oldest mark after
#    which at most 150 us of work is queued, so a training step's kernels under it queue behind each other while
#    0.2 ms matmuls keep one queued; with HOLD_EVENT_DEPTH=8 and chunks up to 150 us).
# Parts 7-12 build each shim they weigh with its flags spelled out (the defaults moved as they were measured), so
# each reproduces the builds of its run in bench/RESULTS.md on later code; "shim" in parts 1-6 is whatever shipped.
# Run with PYTHONPATH holding the carried wheels (bench/device_prelude.sh sets up the rest).
source "$(dirname "$0")/device_prelude.sh"
part=${1:-pace}
build_shim /tmp/shim || exit 1
rc=0
case $part in
pace)
  build_shim /tmp/shim-trace "-O2 -DALNAIR_TRACE" || exit 1
  timeout 180 python3 bench/turn_pace.py --pin --shim /tmp/shim/libalnair.so --shapes small,train --caps 50,70 \
    --rounds 3 --seconds 0.6 --settle 0.2 --json "$OUT/turn_pace.json" > "$OUT/turn_pace.log" 2>&1 || rc=1
  timeout 120 python3 bench/turn_pace.py --pin --shim /tmp/shim-trace/libalnair.so --shapes small,train --caps 50,70 \
    --rounds 2 --seconds 0.6 --settle 0.2 --trace-dir /tmp/pace-traces --json "$OUT/turn_pace_trace.json" \
    > "$OUT/turn_pace_trace.log" 2>&1 || rc=1
  tar -czf "$OUT/pace_traces.tgz" -C /tmp pace-traces 2>/dev/null
  timeout 150 python3 bench/turn_trace.py --pin --shim /tmp/shim/libalnair.so --shapes small --caps 0,-1,50,70 \
    --seconds 2 --profile 0.5 --json "$OUT/trace_small.json" > "$OUT/trace_small.log" 2>&1 || rc=1
  timeout 90 python3 bench/launch_overhead.py --shim /tmp/shim/libalnair.so --json "$OUT/launch_overhead.json" \
    > "$OUT/launch_overhead.log" 2>&1 || rc=1
  tail -n 40 "$OUT/turn_pace.log" "$OUT/turn_pace_trace.log" "$OUT/trace_small.log" "$OUT/launch_overhead.log"
  ;;
latency)
  build_shim /tmp/shim-depth4 "-O2 -DHOLD_EVENT_DEPTH=4" || exit 1
  build_shim /tmp/shim-nobound "-O2 -DHOLD_EVENT_MIN_NS=UINT64_MAX" || exit 1
  for build in shim shim-depth4 shim-nobound; do
    timeout 170 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours train \
      --only latency,latency-elastic --rates 200,500 --seconds 3 --json "$OUT/latency_$build.json" \
      > "$OUT/latency_$build.log" 2>&1 || rc=1
  done
  tail -n 30 "$OUT"/latency_*.log
  ;;
events)
  build_shim /tmp/shim-due "-O2 -DPOLL_WHEN_DUE=1" || exit 1
  build_shim /tmp/shim-few "-O2 -DSAMPLE_EVERY=1024u -DFENCE_EVERY=1024u -DPOLL_EVERY_MASK=31u" || exit 1
  for build in shim shim-due shim-few; do
    timeout 90 python3 bench/launch_overhead.py --shim /tmp/$build/libalnair.so --json "$OUT/overhead_$build.json" \
      > "$OUT/overhead_$build.log" 2>&1 || rc=1
  done
  for build in shim-due shim-few; do
    timeout 110 python3 bench/turn_pace.py --pin --shim /tmp/$build/libalnair.so --shapes train,small,mm-sync \
      --caps 30,70 --rounds 2 --seconds 0.6 --settle 0.2 --json "$OUT/turn_pace_$build.json" \
      > "$OUT/turn_pace_$build.log" 2>&1 || rc=1
  done
  tail -n 12 "$OUT"/overhead_*.log "$OUT"/turn_pace_*.log
  ;;
host)
  build_shim /tmp/shim-spin "-O2 -DWAKE_EARLY_NS=1000000000ull" || exit 1
  build_shim /tmp/shim-early "-O2 -DWAKE_EARLY_NS=2000000ull" || exit 1
  timeout 300 python3 bench/pace_probe.py --build ship=/tmp/shim/libalnair.so --build spin=/tmp/shim-spin/libalnair.so \
    --build early=/tmp/shim-early/libalnair.so --shapes small,train,infer --phases u,f,u,w50,u,w70,u,w20,u,w50,u,w70,u --rounds 2 \
    --json "$OUT/pace_probe_host.json" > "$OUT/pace_probe_host.log" 2>&1 || rc=1
  for build in shim-spin shim-early; do
    timeout 110 python3 bench/turn_pace.py --pin --shim /tmp/$build/libalnair.so --shapes small,train --caps 50,70 \
      --rounds 3 --seconds 0.6 --settle 0.2 --json "$OUT/turn_pace_$build.json" > "$OUT/turn_pace_$build.log" 2>&1 || rc=1
  done
  tail -n 30 "$OUT/pace_probe_host.log" "$OUT"/turn_pace_shim-*.log
  ;;
class)
  build_shim /tmp/shim-due "-O2 -DPOLL_WHEN_DUE=1" || exit 1
  timeout 190 python3 bench/latency_gpu.py --pin --shim /tmp/shim/libalnair.so --neighbours train,mm \
    --only latency,latency-elastic --rates 200,500 --seconds 3 --json "$OUT/latency_class.json" \
    > "$OUT/latency_class.log" 2>&1 || rc=1
  timeout 90 python3 bench/launch_overhead.py --shim /tmp/shim-due/libalnair.so --json "$OUT/overhead_due.json" \
    > "$OUT/overhead_due.log" 2>&1 || rc=1
  tail -n 40 "$OUT/latency_class.log" "$OUT/overhead_due.log"
  ;;
chunk)
  build_shim /tmp/shim-nochunk "-O2 -DHOLD_CHUNK=0 -DHOLD_LONG_DEPTH=2" || exit 1
  build_shim /tmp/shim-chunk "-O2 -DHOLD_CHUNK=1 -DHOLD_LONG_DEPTH=2" || exit 1
  for build in shim-nochunk shim-chunk; do
    timeout 190 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours train,mm \
      --only latency,latency-elastic --rates 200,500 --seconds 3 --json "$OUT/latency_$build.json" \
      > "$OUT/latency_$build.log" 2>&1 || rc=1
  done
  tail -n 32 "$OUT"/latency_shim*.log
  ;;
wait)
  build_shim /tmp/shim-wait "-O2 -DLAT_WAIT_HOLD=1 -DHOLD_LONG_DEPTH=2" || exit 1
  build_shim /tmp/shim-nowait "-O2 -DLAT_WAIT_HOLD=0 -DHOLD_LONG_DEPTH=2" || exit 1
  build_shim /tmp/shim-old "-O2 -DLAT_WAIT_HOLD=0 -DHOLD_CHUNK=0 -DHOLD_LONG_DEPTH=2" || exit 1
  for build in shim-wait shim-nowait shim-old; do
    only=latency,latency-elastic
    [ $build = shim-wait ] && only=$only,idle
    timeout 175 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours train,mm \
      --only $only --rates 200,500 --seconds 3 --json "$OUT/latency_$build.json" \
      > "$OUT/latency_$build.log" 2>&1 || rc=1
  done
  tail -n 30 "$OUT"/latency_shim*.log
  ;;
depth)
  build_shim /tmp/shim-wait "-O2 -DLAT_WAIT_HOLD=1 -DHOLD_LONG_DEPTH=2" || exit 1
  build_shim /tmp/shim-nowait "-O2 -DLAT_WAIT_HOLD=0 -DHOLD_LONG_DEPTH=2" || exit 1
  build_shim /tmp/shim-wait-d1 "-O2 -DLAT_WAIT_HOLD=1 -DHOLD_EVENT_DEPTH=1" || exit 1
  build_shim /tmp/shim-nowait-d1 "-O2 -DLAT_WAIT_HOLD=0 -DHOLD_EVENT_DEPTH=1" || exit 1
  for build in shim-wait shim-nowait shim-wait-d1 shim-nowait-d1 shim-wait; do
    n=$((${n:-0} + 1))
    timeout 150 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours mm \
      --only latency,latency-elastic --rates 200,500 --seconds 3 --json "$OUT/depth${n}_$build.json" \
      > "$OUT/depth${n}_$build.log" 2>&1 || rc=1
  done
  grep -h -E '^(stream|mm) ' "$OUT"/depth*.log | cut -c1-170
  ;;
final)
  build_shim /tmp/shim-d1 "-O2 -DHOLD_EVENT_DEPTH=1" || exit 1
  build_shim /tmp/shim-d2 "-O2 -DHOLD_LONG_DEPTH=2" || exit 1
  timeout 400 python3 bench/latency_gpu.py --pin --shim /tmp/shim-d1/libalnair.so --rates 200,500 --seconds 3 \
    --json "$OUT/final_shim-d1.json" > "$OUT/final_shim-d1.log" 2>&1 || rc=1
  timeout 120 python3 bench/latency_gpu.py --pin --shim /tmp/shim-d2/libalnair.so --neighbours train \
    --only latency,latency-elastic --rates 200,500 --seconds 3 --json "$OUT/final_shim-d2.json" \
    > "$OUT/final_shim-d2.log" 2>&1 || rc=1
  grep -h -E '^(stream|mm|train|idle|flood) ' "$OUT"/final*.log | cut -c1-170
  ;;
marks)
  build_shim /tmp/shim-d1 "-O2 -DHOLD_EVENT_DEPTH=1" || exit 1
  build_shim /tmp/shim-d2 "-O2 -DHOLD_LONG_DEPTH=2" || exit 1
  for build in shim shim-d1 shim-d2; do
    timeout 170 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours train,mm \
      --only latency,latency-elastic --rates 200,500 --seconds 3 --json "$OUT/marks_$build.json" \
      > "$OUT/marks_$build.log" 2>&1 || rc=1
  done
  grep -h -E '^(stream|mm|train) ' "$OUT"/marks_*.log | cut -c1-150
  ;;
paced)
  build_shim /tmp/shim-unpaced "-O2 -Wno-type-limits -DSAMPLE_GAP_NS=0ull -DFENCE_GAP_NS=0ull" || exit 1
  for round in 1 2; do
    for build in shim shim-unpaced; do
      timeout 90 python3 bench/launch_overhead.py --shim /tmp/$build/libalnair.so \
        --json "$OUT/overhead_${build}_$round.json" > "$OUT/overhead_${build}_$round.log" 2>&1 || rc=1
    done
  done
  timeout 330 python3 bench/pace_probe.py --build paced=/tmp/shim/libalnair.so \
    --build unpaced=/tmp/shim-unpaced/libalnair.so --shapes train,infer,small,mm-sync,mm \
    --phases u,f,u,w20,u,w30,u,w50,u,w70,u --rounds 2 --json "$OUT/pace_probe_paced.json" \
    > "$OUT/pace_probe_paced.log" 2>&1 || rc=1
  tail -n 5 "$OUT"/overhead_*.log
  tail -n 30 "$OUT/pace_probe_paced.log"
  ;;
now)
  timeout 560 python3 bench/latency_gpu.py --pin --shim /tmp/shim/libalnair.so --rates 200,500 --seconds 3 \
    --json "$OUT/now.json" > "$OUT/now.log" 2>&1 || rc=1
  grep -v '^{' "$OUT/now.log" | tail -n 45 | cut -c1-200
  ;;
slack)
  build_shim /tmp/shim-s0 "-O2 -Wno-type-limits -DLAT_SAMPLE_SLACK_PCT=0ull -DLAT_SAMPLE_VS_ESTIMATE=0" || exit 1
  build_shim /tmp/shim-off "-O2 -DLAT_SAMPLE_SLACK_PCT=1000000ull" || exit 1
  n=0
  for build in shim shim-s0 shim-off shim; do
    n=$((n + 1))
    timeout 110 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours mm --only flood \
      --rates 200 --seconds 3 --json "$OUT/slack${n}_$build.json" > "$OUT/slack${n}_$build.log" 2>&1 || rc=1
    echo "$n $build: $(grep -h -E '^mm +flood' "$OUT/slack${n}_$build.log" | cut -c1-170)"
  done
  ;;
budget)
  build_shim /tmp/shim-g "-O2 -DHOLD_CHUNK_MAX_NS=200000ull" || exit 1
  build_shim /tmp/shim-b "-O2 -DHOLD_EVENT_DEPTH=8 -DHOLD_QUEUE_WORK_NS=150000ull -DHOLD_CHUNK_MAX_NS=150000ull" || exit 1
  for build in shim shim-g shim-b; do
    timeout 175 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours train,mm \
      --only latency,latency-elastic --rates 500 --seconds 3 --json "$OUT/budget_$build.json" \
      > "$OUT/budget_$build.log" 2>&1 || rc=1
    echo "== $build"; grep -h -E '^(stream|mm|train) ' "$OUT/budget_$build.log" | cut -c1-200
  done
  ;;
*)
  echo "usage: $0 pace|latency|events|host|class|chunk|wait|depth|final|marks|paced|now|slack|budget" >&2
  exit 2
  ;;
esac
exit $rc
