#!/usr/bin/env bash
# build-asan/: the runtime alone (no LLVM/MLIR) built with clang-19 under
# AddressSanitizer + UndefinedBehaviorSanitizer, with libFuzzer's coverage
# (-DFSDP_FUZZ=ON: -fsanitize=fuzzer-no-link,address,undefined on every
# library, the harnesses linked with -fsanitize=fuzzer). One build serves
# scripts/sanitize-check.sh (the unit tests and fsdp-run) and
# scripts/fuzz-smoke.sh (the runtime's harnesses): CI used to compile the
# runtime twice, with gcc for the sanitizers and clang for the fuzzers, and
# clang compiles it instrumented in about a third of gcc's time
# (docs/RELIABILITY.md).
#
# Usage: scripts/asan-build.sh [TARGET...]   (default: every target)
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_BASEDIR="$PWD"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/fsdp-ccache}"
JOBS="${JOBS:-$(nproc)}"
cmake -G Ninja -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFSDP_RUNTIME_ONLY=ON -DFSDP_FUZZ=ON \
  -DCMAKE_C_COMPILER=clang-19 -DCMAKE_CXX_COMPILER=clang++-19 \
  -DCMAKE_DISABLE_FIND_PACKAGE_MLIR=ON -DCMAKE_DISABLE_FIND_PACKAGE_LLVM=ON >/dev/null
if (($#)); then
  cmake --build build-asan -j "$JOBS" --target "$@"
else
  cmake --build build-asan -j "$JOBS"
fi
