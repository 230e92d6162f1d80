#!/usr/bin/env bash
# libFuzzer smoke runs: builds the harnesses of fuzz/ (clang-19,
# -fsanitize=fuzzer,address,undefined; the runtime's in build-asan/, runtime
# only (scripts/asan-build.sh); the compiler's, mlir, in build-fuzz-mlir/
# with the compiler) and fuzzes
# each named harness for a short time from its seed corpus in the repo
# (fuzz/corpus/<name>/) with its dictionary. Fails on any crash, sanitizer
# report, leak, timeout (> 10 s per input) or out-of-memory (> 2 GiB).
#
# Usage: scripts/fuzz-smoke.sh [HARNESS...]   (default: plan safetensors tokens checkpoint mlir)
#   FUZZ_SECONDS=N   seconds per harness (default 60 for plan, 30 for the others)
#   FUZZ_KEEP=DIR    keep the grown corpora and any crash inputs in DIR
# The plan harness first replays fuzz/crashes/*.json, the reproducers of
# known crashes: it stays red until they are fixed (then move each one to
# fuzz/corpus/plan/ as a regression input). Longer runs: fuzz/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
export CCACHE_BASEDIR="$PWD"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/fsdp-ccache}"
JOBS="${JOBS:-$(nproc)}"
HARNESSES=("$@")
((${#HARNESSES[@]})) || HARNESSES=(plan safetensors tokens checkpoint mlir)

start=$(date +%s)
targets=()
mlir=0
for h in "${HARNESSES[@]}"; do
  if [[ $h == mlir ]]; then mlir=1; else targets+=("${h}_fuzzer"); fi
done
if ((${#targets[@]})); then
  # The runtime's harnesses: in sanitize-check.sh's build (built there
  # already when CI gets here).
  bash scripts/asan-build.sh "${targets[@]}"
fi
if ((mlir)); then
  # The compiler instrumented (the fsdp libraries; LLVM/MLIR are Debian's).
  cmake -G Ninja -S . -B build-fuzz-mlir -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFSDP_FUZZ=ON -DFSDP_CUDA=OFF \
    -DCMAKE_C_COMPILER=clang-19 -DCMAKE_CXX_COMPILER=clang++-19 >/dev/null
  cmake --build build-fuzz-mlir -j "$JOBS" --target mlir_fuzzer
fi
echo "fuzz build: $(( $(date +%s) - start )) s"

SUPP="$ROOT/scripts/sanitizers"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SUPP/ubsan.supp"
export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
W="${FUZZ_KEEP:-$(mktemp -d /tmp/fsdp-fuzz.XXXXXX)}"
mkdir -p "$W"
[[ -n "${FUZZ_KEEP:-}" ]] || trap 'rm -rf "$W"' EXIT

status=0
for h in "${HARNESSES[@]}"; do
  bin="build-asan/bin/${h}_fuzzer"
  [[ $h != mlir ]] || bin="build-fuzz-mlir/bin/${h}_fuzzer"
  secs="${FUZZ_SECONDS:-$([[ $h == plan ]] && echo 60 || echo 30)}"
  dict=()
  [[ -f "fuzz/$h.dict" ]] && dict=(-dict="fuzz/$h.dict")
  if [[ $h == plan ]] && compgen -G "fuzz/crashes/*.json" >/dev/null; then
    for c in fuzz/crashes/*.json; do
      if ! "$bin" "$c" >"$W/replay.log" 2>&1; then
        echo "fuzz-smoke: $h: known crash not fixed yet: $c" >&2
        grep -E 'ERROR|runtime error|#[0-3] ' "$W/replay.log" | head -6 >&2
        status=1
      fi
    done
  fi
  mkdir -p "$W/$h.corpus" "$W/$h.artifacts"
  t0=$(date +%s)
  rc=0
  "$bin" "${dict[@]}" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$W/$h.artifacts/" \
    "$W/$h.corpus" "fuzz/corpus/$h" >"$W/$h.log" 2>&1 || rc=$?
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$W/$h.log" | grep -oE '[0-9]+$' || echo "?")
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$W/$h.log" | tail -1 || true)
  if ((rc != 0)) || compgen -G "$W/$h.artifacts/*" >/dev/null; then
    echo "fuzz-smoke: $h: FAILED (exit $rc) after $(( $(date +%s) - t0 )) s; input(s):" >&2
    ls "$W/$h.artifacts" >&2 || true
    grep -E 'ERROR|runtime error|SUMMARY|^ +#[0-9]+ ' "$W/$h.log" | cut -c1-200 | head -20 >&2
    status=1
  else
    echo "fuzz-smoke: $h: ok, $execs execs in $(( $(date +%s) - t0 )) s, 0 crashes ($cov)"
  fi
done
echo "fuzz-smoke: $(( $(date +%s) - start )) s in all"
exit $status
