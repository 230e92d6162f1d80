#!/usr/bin/env bash
# Runs every test: installs the apt dependencies, builds the compiler and the
# runtime, checks that the runtime builds alone without LLVM/MLIR, and runs
# ctest (GoogleTest suites + the lit suite, which includes the end-to-end
# training tests against PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

export CCACHE_BASEDIR="$PWD"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/fsdp-ccache}"
JOBS="${JOBS:-$(nproc)}"

start=$(date +%s)
cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$JOBS"
echo "build: $(( $(date +%s) - start )) s"

# The runtime alone: MLIR and LLVM are made unfindable, so the configure
# fails if the runtime-only build reaches for them.
cmake -G Ninja -S . -B build-runtime-only -DCMAKE_BUILD_TYPE=Release \
  -DFSDP_RUNTIME_ONLY=ON -DCMAKE_DISABLE_FIND_PACKAGE_MLIR=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_LLVM=ON >/dev/null
cmake --build build-runtime-only -j "$JOBS" --target fsdp-run
if ldd build-runtime-only/bin/fsdp-run | grep -Ei 'llvm|mlir'; then
  echo "error: the runtime-only fsdp-run links LLVM/MLIR" >&2
  exit 1
fi
echo "runtime-only build: ok (fsdp-run links no LLVM/MLIR)"

ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 3000

# The same suite on every other OpenBLAS kernel this CPU can run: a
# tolerance that holds on one kernel only fails here (test/oracle/README.md).
bash scripts/coretype-sweep.sh build --skip-unset

# The runtime under ASan + UBSan + LSan: unit tests and an end-to-end subset
# on plans compiled by the build above (docs/RELIABILITY.md).
bash scripts/sanitize-check.sh build/bin/fsdp-opt


# libFuzzer smoke runs (clang-19): each harness a short time from its seed
# corpus (fuzz/README.md): plan 60 s (after replaying fuzz/crashes/),
# safetensors, tokens, checkpoint and the compiler's mlir harness 30 s each.
bash scripts/fuzz-smoke.sh
