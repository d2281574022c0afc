#!/usr/bin/env bash
# Issue 26's floor, on the device machine, in one call: does an MPS server take the GPU's context switch out of a
# latency request's wait? The latency stream beside each neighbour (bench/latency_gpu.py: no Alnair, and the
# latency class), three ways one after another, each with its own alone references:
#   ts       the driver's time-slicing between contexts (as shipped);
#   mps      every tenant a client of one MPS server (kernels of two processes on the GPU at once);
#   mps-70   the same, the neighbour beside the stream limited to 70 % of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).
#   bash bench/gpu_mps.sh [RATES]       (results and logs into $OUT, else bench/out; RATES default 500)
# and, with `holds`, what the board's holds still give a request under MPS and cost its neighbours: every run
# under MPS, the latency class strict and elastic beside both neighbours, four builds one after another:
#   before   the shim before HOLD_MPS_SHORT_FREE (a neighbour holds back while the board says a request runs, and
#            keeps its queue short; the fourteenth session's run of this called it `shim`);
#   noboard  -DHOLD_BOARD=2: no board holds where the contexts are an MPS server's clients, the short queue kept;
#   work     the same, the queue bounded by 150 us of work instead of two marks (-DHOLD_QUEUE_WORK_NS);
#   free     the same, no bound on the queue at all (what the turns alone give);
#   bash bench/gpu_mps.sh holds [RATES]
# and, with `short`, the rule that came of it (HOLD_MPS_SHORT_FREE: under MPS a neighbour's short launches are free of
# the holds, its long ones keep them) against the shim without it, the same runs:
#   bash bench/gpu_mps.sh short [RATES]
# The MPS server runs as this user with its pipe and log folders under /tmp (no setting of the GPU changes) and is
# told to quit at the end, whatever happened. Exit status: non-zero if a step failed or MPS could not start.
source "$(dirname "$0")/device_prelude.sh"
mode=compare
if [ "${1:-}" = holds ] || [ "${1:-}" = short ]; then
  mode=$1
  shift
fi
rates=${1:-500}
shim=/tmp/mps-shim/libalnair.so
if [ "$mode" != holds ]; then
  build_shim /tmp/mps-shim || exit 1
fi
args=(--pin --shim "$shim" --neighbours mm,train --only no-alnair,latency --rates "$rates" --seconds 3)
rc=0
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/alnair-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/alnair-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control; sleep 1; cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log" 2> /dev/null' EXIT
  nvidia-cuda-mps-control -d || { echo "gpu_mps: the MPS control daemon did not start" >&2; exit 1; }
}
if [ "$mode" != compare ]; then
  build_shim /tmp/mps-before "-O2 -DHOLD_MPS_SHORT_FREE=0" || exit 1
  if [ "$mode" = holds ]; then
    builds="before noboard work free"
    build_shim /tmp/mps-noboard "-O2 -DHOLD_BOARD=2 -DHOLD_MPS_SHORT_FREE=0" || exit 1
    build_shim /tmp/mps-work "-O2 -DHOLD_BOARD=2 -DHOLD_MPS_SHORT_FREE=0 -DHOLD_EVENT_DEPTH=8 -DHOLD_QUEUE_WORK_NS=150000ull -DHOLD_CHUNK_MAX_NS=150000ull" || exit 1
    build_shim /tmp/mps-free "-O2 -Wno-type-limits -DHOLD_BOARD=2 -DHOLD_EVENT_MIN_NS=UINT64_MAX -DHOLD_QUEUE_NS=1000000000ull" || exit 1
  else
    builds="shim before"
  fi
  start_mps
  python3 - <<'PY' || rc=1
import ctypes
import torch
torch.ones(1, device="cuda")
cu, v = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(-1)
print("an MPS client:", torch.cuda.get_device_name(), "MPS_ENABLED =",
      cu.cuDeviceGetAttribute(ctypes.byref(v), 133, 0), v.value)
PY
  for b in $builds; do
    so=/tmp/mps-$b/libalnair.so
    [ "$b" = shim ] && so=$shim
    echo "== $b $(date -u +%T)"
    timeout 250 python3 bench/latency_gpu.py --pin --shim "$so" --neighbours train,mm --only latency,latency-elastic \
      --rates "$rates" --seconds 2.5 --json "$OUT/${mode}_$b.json" > "$OUT/${mode}_$b.log" 2>&1 || rc=1
    grep -h -E '^(stream|mm|train) ' "$OUT/${mode}_$b.log" | cut -c1-200
  done
  exit $rc
fi
one() {  # one NAME [latency_gpu args]
  local name=$1
  shift
  echo "== $name $(date -u +%T)"
  timeout 170 python3 bench/latency_gpu.py "${args[@]}" "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || rc=1
  sed -n '/^shape/,$p' "$OUT/$name.log" | head -40
}
one ts
if ! command -v nvidia-cuda-mps-control > /dev/null; then
  echo "gpu_mps: nvidia-cuda-mps-control not found: no MPS here" >&2
  exit 1
fi
start_mps
python3 -c "import torch; torch.ones(1, device='cuda'); print('an MPS client:', torch.cuda.get_device_name())" || rc=1
one mps
one mps-70 --neighbour-env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=70
exit $rc
