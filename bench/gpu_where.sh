#!/usr/bin/env bash
# Issue 25, where a host-bound program's time goes, in one device call (sixteenth session):
#  1. bench/gpu_small_cap.sh: the small-kernel loop at cap 30 through the agent, four builds;
#  2. bench/turn_trace.py, the small loop alone with no shim, at cap 30 and at cap 99 (metered, windows all but
#     never closed), the trace build, torch.profiler for 0.5 s after each loop (the launch call's own time), and
#     bench/nvml_clocks.py beside it all (does the GPU idle down between windows?);
#     Then the loop at cap 30 again with 25 ms periods instead of 100 (shipped build): a pace that comes back
#     with shorter off-times says the GPU's idling is the cause (seventeenth session);
#  3. bench/launch_overhead.py, the shipped build and the trace build (its probes: where a metered launch's host
#     time goes, and how many event calls it makes, on the real driver).
# Everything into $OUT/where.tgz (the device hands back 8 files at most).
#   bash bench/gpu_where.sh
source "$(dirname "$0")/device_prelude.sh"
R=$OUT
export OUT=/tmp/where
mkdir -p "$OUT/tt" "$OUT/lo"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,compute_mode --format=csv > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
rc=0
bash bench/gpu_small_cap.sh > "$OUT/small_cap.txt" 2>&1 || rc=1
tail -25 "$OUT/small_cap.txt"
taskset -c 0 python3 bench/nvml_clocks.py --out "$OUT/clocks.jsonl" --every-ms 5 --seconds 400 > "$OUT/clocks.txt" 2>&1 &
clk=$!
echo "== turn_trace $(date -u +%T) mono $(python3 -c 'import time; print(time.monotonic_ns())')"
timeout 150 python3 bench/turn_trace.py --pin --shim /tmp/sc-trace/libalnair.so --shapes small --caps 0,30,99,0,30 \
  --seconds 2 --profile 0.5 --trace-dir "$OUT/tt" --json "$OUT/tt.json" > "$OUT/tt.txt" 2>&1 || rc=1
echo "== turn_trace done mono $(python3 -c 'import time; print(time.monotonic_ns())')"
cut -c1-400 "$OUT/tt.txt" | tail -8
# the same loop at cap 30 with 25 ms periods (7.5 ms windows, 17.5 ms off instead of 70): if the GPU idling down
# between windows is what slows it, its pace in the windows comes back here (seventeenth session)
echo "== turn_trace period 25 ms $(date -u +%T) mono $(python3 -c 'import time; print(time.monotonic_ns())')"
timeout 90 python3 bench/turn_trace.py --pin --shim /tmp/sc-shim/libalnair.so --shapes small --caps 0,30,0,30 \
  --seconds 2 --setting turn_period_s=0.025 --json "$OUT/tt25.json" > "$OUT/tt25.txt" 2>&1 || rc=1
echo "== turn_trace period 25 ms done mono $(python3 -c 'import time; print(time.monotonic_ns())')"
cut -c1-400 "$OUT/tt25.txt" | tail -6
for f in "$OUT"/tt/*.sum; do echo "$f"; cat "$f"; done
for b in shim trace; do
  extra=()
  [ "$b" = trace ] && extra=(--trace-dir "$OUT/lo")
  timeout 150 python3 bench/launch_overhead.py --shim "/tmp/sc-$b/libalnair.so" --json "$OUT/lo_$b.json" "${extra[@]}" \
    > "$OUT/lo_$b.txt" 2>&1 || rc=1
  tail -5 "$OUT/lo_$b.txt"
done
for f in "$OUT"/lo/*.sum; do echo "$f"; cat "$f"; done
kill "$clk" 2>/dev/null
wait "$clk" 2>/dev/null
for t in tt tt25; do  # the SM clock through each loop, by phase of its period (head of the window against its tail)
  echo "== clocks by phase: $t"
  python3 bench/nvml_clocks.py --fold "$OUT/clocks.jsonl" --turns "$OUT/$t.json" | cut -c1-400
done
(cd /tmp && tar czf "$R/where.tgz" where)
exit $rc
