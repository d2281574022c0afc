#!/usr/bin/env bash
# Issues 25 and 26's open questions on the H200, each part one device call of at most ~9 min (each step has its
# timeout; a run cut short keeps its JSON); results and logs into $OUT, else bench/out:
#   bash bench/gpu_pace_latency.sh pace       1. + 3.
#   bash bench/gpu_pace_latency.sh latency    2.
# 1. Where the small-kernel loop's time goes at caps 50 / 70 (45 / 63 % judged in one process, 2026-12-03):
#    bench/turn_trace.py --profile, the loop alone uncapped, through the agent uncapped, and at 50 and 70; then
#    bench/turn_pace.py for the small loop and the training step with more rounds.
# 2. What the latency class's event bound costs a host-bound training neighbour and gives a request beside it:
#    bench/latency_gpu.py beside train with the shipped shim (at most 2 long launches queued), a build allowing 4
#    (-DHOLD_EVENT_DEPTH=4) and one without the bound (-DHOLD_EVENT_MIN_NS=UINT64_MAX); each pair run records the
#    neighbour's held-back time and count.
# 3. bench/launch_overhead.py: the metered path in process and across processes, judged.
# Run from the repo root with PYTHONPATH holding the carried wheels (bench/gpu_session.sh has the set-up).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
part=${1:-pace}
make -s -C shim BUILD=/tmp/shim CC=cc || exit 1
rc=0
case $part in
pace)
  timeout 170 python3 bench/turn_trace.py --pin --shim /tmp/shim/libalnair.so --shapes small --caps 0,-1,50,70 \
    --seconds 2 --profile 0.5 --json "$OUT/trace_small.json" > "$OUT/trace_small.log" 2>&1 || rc=1
  timeout 250 python3 bench/turn_pace.py --pin --shim /tmp/shim/libalnair.so --shapes small,train --caps 50,70 \
    --rounds 4 --seconds 0.6 --settle 0.2 --json "$OUT/turn_pace.json" > "$OUT/turn_pace.log" 2>&1 || rc=1
  timeout 100 python3 bench/launch_overhead.py --shim /tmp/shim/libalnair.so --json "$OUT/launch_overhead.json" \
    > "$OUT/launch_overhead.log" 2>&1 || rc=1
  tail -n 40 "$OUT/trace_small.log" "$OUT/turn_pace.log" "$OUT/launch_overhead.log"
  ;;
latency)
  make -s -C shim BUILD=/tmp/shim-depth4 CC=cc CFLAGS="-O2 -DHOLD_EVENT_DEPTH=4" || exit 1
  make -s -C shim BUILD=/tmp/shim-nobound CC=cc CFLAGS="-O2 -DHOLD_EVENT_MIN_NS=UINT64_MAX" || exit 1
  for build in shim shim-depth4 shim-nobound; do
    timeout 170 python3 bench/latency_gpu.py --pin --shim /tmp/$build/libalnair.so --neighbours train \
      --only latency,latency-elastic --rates 200,500 --seconds 3 --json "$OUT/latency_$build.json" \
      > "$OUT/latency_$build.log" 2>&1 || rc=1
  done
  tail -n 30 "$OUT"/latency_*.log
  ;;
*)
  echo "usage: $0 pace|latency" >&2
  exit 2
  ;;
esac
exit $rc
