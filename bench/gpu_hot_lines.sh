#!/usr/bin/env bash
# Issue 25, eighteenth session: what the metered launch costs a program that does work of its own between launches,
# and whether the shim's launch state on fewer cache lines (42bff74) and its code on two pages (shim/hot_text.ld)
# lower it. Two shim builds made on the dev box with one toolchain and carried (the device builds nothing here):
# .out/shim_old (1802217, before) and .out/shim_new (both changes), made by `bash bench/hot_lines_builds.sh`.
#  1. bench/launch_overhead.py --gap-kb 256,4096, old, new, old, new: in one process, the hook against the real
#     driver function with that much memory touched before each launch (cold caches), beside the back-to-back pairs;
#  2. bench/pace_probe.py, both builds, two rounds: one process each, its phases u (the shim uncapped: its own
#     reference), f (capped, lent the whole GPU: every launch metered, none held) and w30 (its windows), so the
#     metered path's cost in a real loop (f against u) is judged inside one process, free of the 20 % that host-bound
#     references move between processes;
#  3. bench/turn_trace.py --pin, small, train and infer, caps 0 (no shim), -1 (shim, uncapped), 99 (metered, the
#     window all but never closed) twice each, new build; then 0 and 99 twice each, old build: the metered path's cost
#     inside a real loop, against the same loop with no shim in the processes around it.
# Everything into $OUT/hot.tgz; the tables are printed.
#   bash bench/gpu_hot_lines.sh            (SHAPES=small,train for a shorter call)
source "$(dirname "$0")/device_prelude.sh"
R=$OUT
export OUT=/tmp/hot
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,compute_mode --format=csv | tee "$OUT/gpu.txt"
rc=0
for b in old new old new; do
  n=$(ls "$OUT"/lo_"$b"_*.json 2>/dev/null | wc -l)
  echo "== launch_overhead $b $(date -u +%T)"
  timeout 120 python3 bench/launch_overhead.py --shim ".out/shim_$b/libalnair.so" --gap-kb 256,4096 \
    --json "$OUT/lo_${b}_$n.json" > "$OUT/lo_${b}_$n.txt" 2>&1 || rc=1
  grep -E 'in-process|spread' "$OUT/lo_${b}_$n.txt"
  (cd /tmp && tar czf "$R/hot.tgz" hot)  # after each part: a call cut short still brings back what ran
done
echo "== pace_probe $(date -u +%T)"
timeout 200 python3 bench/pace_probe.py --build old=.out/shim_old/libalnair.so --build new=.out/shim_new/libalnair.so \
  --shapes "${SHAPES:-small,train,infer}" --phases u,f,u,w30,u,f,u,w30,u --rounds 2 --json "$OUT/pp.json" \
  > "$OUT/pp.txt" 2>&1 || rc=1
tail -15 "$OUT/pp.txt" | cut -c1-200
(cd /tmp && tar czf "$R/hot.tgz" hot)
for b in new old; do
  caps=0,-1,99,0,-1,99
  [ "$b" = old ] && caps=0,99,0,99
  echo "== turn_trace $b $(date -u +%T)"
  timeout 200 python3 bench/turn_trace.py --pin --shim ".out/shim_$b/libalnair.so" --shapes "${SHAPES:-small,train,infer}" \
    --caps "$caps" --seconds 2 --json "$OUT/tt_$b.json" > "$OUT/tt_$b.txt" 2>&1 || rc=1
  python3 - "$OUT/tt_$b.json" <<'PY' || rc=1
import json, sys
d = json.load(open(sys.argv[1]))["results"]
for run in d["runs"]:
    for cap, s in zip(run.get("caps", []), run.get("summary", [])):
        print(f"{run['shape']:6} cap {cap:3}: {s.get('rate')} /s, median step {s.get('median_step_us')} us")
    if "error" in run:
        print(run["shape"], run["caps"], "error", run["error"][:300])
PY
  (cd /tmp && tar czf "$R/hot.tgz" hot)
done
exit $rc
