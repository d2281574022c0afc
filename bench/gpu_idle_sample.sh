#!/usr/bin/env bash
# Issue 25: the shipped shim against the diagnostic build that takes an idle GPU's host time off a sample
# (-DIDLE_SAMPLE=1, shim/launch_internal.h says why it is not the default), one after the other in one device call,
# so both builds meet the same machine. The seventeenth session built it with no device: on the simulated
# driver an elastic container's counted GPU time over the GPU time it used went 1.22 -> 0.98 for a training step and
# 4.0 -> 1.78 for 2 us kernels, GPU-bound programs unchanged (tests/shim/test_shim_idle_sample.py), and a host-bound
# container's usage beside a GPU-bound one +12.9 -> +3.7 points (tests/test_usage_host_bound.py). What only a GPU
# says: whether the real driver's start event has run when the shim asks right after recording it on an idle stream
# (the probe sums' sample_idle count against sample), and what it does to the five shapes' pace and usage.
#   bash bench/gpu_idle_sample.sh pace     turn_pace (host-bound shapes at cap 30, judged against themselves lent the
#                                          GPU) and launch_overhead with its probe sums, each build, shipped first (~7 min)
#   bash bench/gpu_idle_sample.sh shares   shares_gpu --only caps,elastic,usage --caps 30 for every shape, each build
#                                          (~9 min: give it a call of its own)
# Results and logs into $OUT/idle_sample (else bench/out/idle_sample); everything also in
# $OUT/idle_sample_PART.tgz.
source "$(dirname "$0")/device_prelude.sh"
part=${1:-pace}
build_shim /tmp/is-shim || exit 1
build_shim /tmp/is-idle "-O2 -DIDLE_SAMPLE=1" || exit 1
build_shim /tmp/is-trace "-O2 -DIDLE_SAMPLE=1 -DALNAIR_TRACE" || exit 1
D=$OUT/idle_sample
mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version,power.limit,compute_mode --format=csv | tee "$D/gpu.txt"
rc=0
for b in shim idle; do
  case $part in
    pace)
      echo "== turn_pace $b $(date -u +%T)"
      timeout 150 python3 bench/turn_pace.py --pin --shim "/tmp/is-$b/libalnair.so" --shapes small,train,infer \
        --caps 30 --json "$D/tp_$b.json" > "$D/tp_$b.txt" 2>&1 || rc=1
      tail -6 "$D/tp_$b.txt" | cut -c1-220
      echo "== launch_overhead $b $(date -u +%T)"
      timeout 100 python3 bench/launch_overhead.py --shim "/tmp/is-$b/libalnair.so" --json "$D/lo_$b.json" \
        > "$D/lo_$b.txt" 2>&1 || rc=1
      tail -5 "$D/lo_$b.txt"
      ;;
    shares)
      echo "== shares_gpu $b $(date -u +%T)"
      timeout 280 python3 bench/shares_gpu.py --pin --shim "/tmp/is-$b/libalnair.so" --only caps,elastic,usage \
        --caps 30 --seconds 2 --json "$D/sh_$b.json" > "$D/sh_$b.txt" 2>&1 || rc=1
      grep -E "^(mm|mm-sync|small|train|infer|alone)" "$D/sh_$b.txt" | cut -c1-200
      ;;
    *)
      echo "gpu_idle_sample.sh: part must be pace or shares, not '$part'" >&2
      exit 2
      ;;
  esac
done
if [ "$part" = pace ]; then
  # the probe sums of the diagnostic build's in-process runs: how many samples the real driver let it correct
  mkdir -p "$D/lo_trace"
  timeout 100 python3 bench/launch_overhead.py --shim /tmp/is-trace/libalnair.so --json "$D/lo_trace.json" \
    --trace-dir "$D/lo_trace" > "$D/lo_trace.txt" 2>&1 || rc=1
  for f in "$D"/lo_trace/*.sum; do echo "$f"; grep -E "^(launch|sample|sample_idle|event_record|event_query|fence) " "$f"; done
fi
(cd "$OUT" && tar czf "idle_sample_$part.tgz" idle_sample)
exit $rc
