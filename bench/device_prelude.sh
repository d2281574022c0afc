# Sourced by the device machine's scripts (bench/gpu_session.sh, bench/gpu_pace_latency.sh): the checkout run
# uninstalled, results and logs into $OUT (else bench/out), and how the shim is built there.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# alnair_agent and alnair_standins from here, the benchmarks' modules (which tests/gpu import) from bench/.
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}

# build_shim DIR [CFLAGS]: DIR/libalnair.so, by the pinned toolchain (zig cc, glibc 2.17) when `ziglang` is
# installed, else by the host compiler; CFLAGS (default -O2) for diagnostic builds (-DPOLL_WHEN_DUE=1, ...).
build_shim() {
  local cflags=${2:--O2}
  make -s -C shim BUILD="$1" PYTHON=python3 CFLAGS="$cflags" 2>/dev/null ||
    make -s -C shim BUILD="$1" CC=cc CFLAGS="$cflags"
}
