#!/usr/bin/env bash
# Issue 25's small-kernel loop at cap 30, short of its cap in the GPU tests of 2026-12-07 (22.1 % against 30 +- 3,
# its reference steady): where its time goes, in one device call. `bench/shares_gpu.py --pin --only caps --shapes
# small --caps 30` with the shipped shim, the build without the twelfth session's late push (-DLATE_PUSH=0), the
# trace build (its records summed over the run by bench/shim_trace.py's summarise), and the shipped shim again.
#   bash bench/gpu_small_cap.sh          (results and logs into $OUT, else bench/out)
source "$(dirname "$0")/device_prelude.sh"
build_shim /tmp/sc-shim || exit 1
build_shim /tmp/sc-nopush "-O2 -DLATE_PUSH=0" || exit 1
build_shim /tmp/sc-trace "-O2 -DALNAIR_TRACE" || exit 1
rc=0
one() {  # one NAME BUILD [shares_gpu args]
  local name=$1 build=$2
  shift 2
  echo "== $name $(date -u +%T)"
  timeout 100 python3 bench/shares_gpu.py --pin --shim "/tmp/sc-$build/libalnair.so" --only caps --shapes small \
    --caps 30 --seconds 2.5 --json "$OUT/sc_$name.json" "$@" > "$OUT/sc_$name.log" 2>&1 || rc=1
  grep -E "^(small|alone)" "$OUT/sc_$name.log" | cut -c1-180
}
one shipped shim
one nopush nopush
mkdir -p "$OUT/sc-trace"
one trace trace --trace-dir "$OUT/sc-trace"
one shipped-again shim
python3 - "$OUT/sc-trace" <<'PY' || rc=1
import json, sys
from pathlib import Path
from shim_trace import read, summarise
for p in sorted(Path(sys.argv[1]).glob("*.trace")):
    recs = read(p)
    if recs:
        print(p.name, json.dumps(summarise(recs, recs[0][1], recs[-1][1] + 1)))
PY
exit $rc
