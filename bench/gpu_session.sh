#!/usr/bin/env bash
# Every GPU test and the shim benchmarks, on the device machine, in one call:
#   bash bench/gpu_session.sh            (results and logs into $OUT, else bench/out)
# Builds the shim (make -C shim BUILD=/tmp/shim), runs all tests marked gpu under tests/gpu (anyone's), then
# bench/shares_gpu.py (issue 18's table, ~7.5 min), bench/launch_overhead.py, bench/cuda_startup.py and
# bench/shim_startup.py. pytest runs without this repo's setup.cfg (-c /dev/null):
# the device has no pytest-asyncio, and tests/gpu need none. Exit status: non-zero if any step failed.
source "$(dirname "$0")/device_prelude.sh"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "kernel $(uname -r), $(nproc) cpus, $(cc --version | head -1)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

build_shim /tmp/shim || exit 1
export ALNAIR_SHIM=/tmp/shim/libalnair.so ALNAIR_GPU_RESULTS="$OUT"
rc=0
timeout 540 python3 -m pytest -c /dev/null --rootdir=. --confcutdir=tests/gpu -p no:cacheprovider -m gpu tests/gpu \
  -v -rs -W ignore::pytest.PytestUnknownMarkWarning 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
# SIGTERM at the limit: the scenario under way is cleaned up, the table of the others printed, the JSON kept
timeout 540 python3 bench/shares_gpu.py --shim "$ALNAIR_SHIM" --json "$OUT/shares.json" 2>&1 \
  | tee "$OUT/shares.log" || rc=1
timeout 150 python3 bench/launch_overhead.py --shim "$ALNAIR_SHIM" --json "$OUT/launch_overhead.json" 2>&1 \
  | tee "$OUT/bench.log" || rc=1
timeout 300 python3 bench/cuda_startup.py --shim "$ALNAIR_SHIM" --json "$OUT/cuda_startup.json" 2>&1 \
  | tee -a "$OUT/bench.log" || rc=1
timeout 300 python3 bench/shim_startup.py --shim "$ALNAIR_SHIM" --json "$OUT/shim_startup.json" 2>&1 \
  | tee -a "$OUT/bench.log" || rc=1
exit $rc
