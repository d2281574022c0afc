#!/usr/bin/env bash
# Run on the dev box before bench/gpu_hot_lines.sh: the two shim builds it weighs, made with one toolchain (the pinned
# zig cc) and put where the device call carries them from (.out is ignored by git; name it in the call's carry).
#   bash bench/hot_lines_builds.sh [OLD_COMMIT]     (default 1802217: the launch path's layout before 42bff74)
#   .out/shim_old/libalnair.so   the shim at OLD_COMMIT
#   .out/shim_new/libalnair.so   the shim as checked out here
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:-1802217}
py=${PYTHON:-$PWD/.venv/bin/python}
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/src" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/src" "$old"
make -s -C "$tmp/src/shim" BUILD="$tmp/old" PYTHON="$py"
make -s -C shim BUILD="$tmp/new" PYTHON="$py"
mkdir -p .out/shim_old .out/shim_new
cp "$tmp/old/libalnair.so" .out/shim_old/libalnair.so
cp "$tmp/new/libalnair.so" .out/shim_new/libalnair.so
ls -l .out/shim_old/libalnair.so .out/shim_new/libalnair.so
