#!/usr/bin/env bash
# Runs the whole ctest suite once per OpenBLAS kernel this CPU can execute:
# OPENBLAS_CORETYPE unset, then Prescott (SSE3), Haswell and Zen (AVX2),
# SkylakeX and Cooperlake (AVX-512) where the CPU has the instructions. A
# tolerance that holds on one kernel only fails here. A core type whose
# arithmetic the library shows to be an earlier one's (the same blocking
# and the same code for every routine we and the oracle call:
# scripts/openblas_kernels.py) is skipped, visibly: its run would repeat
# that one bit for bit. Needs a build
# (scripts/test.sh makes one; it runs this sweep after its own ctest, with
# --skip-unset). SWEEP_TESTS=REGEX reruns only the tests it matches (ctest -R).
# usage: bash scripts/coretype-sweep.sh [BUILD_DIR] [--skip-unset]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
skip_unset="${2:-}"
JOBS="${JOBS:-$(nproc)}"
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]]; }

types=(unset Prescott)
[ "$skip_unset" = --skip-unset ] && types=(Prescott)
has avx2 && types+=(Haswell Zen)
has avx512f && has avx512bw && has avx512vl && types+=(SkylakeX)
has avx512_bf16 && types+=(Cooperlake)

failed=()
# Tests that run none of our kernels skip the reruns (lit's coretype-sweep),
# and so do the CUDA emulator's suites (emu.*: the GPU kernels against
# their CPU twins, in CI's time budget once is enough).
export FSDP_CORETYPE_SWEEP=1
exclude=(-E '^emu\.')
[ -n "${SWEEP_TESTS:-}" ] && exclude+=(-R "$SWEEP_TESTS")
lib=$(ldd "$build/bin/fsdp-run" | awk '/openblas|libblas/ {print $3; exit}')
lib=$(readlink -f "$lib" 2>/dev/null || true)
ran=()
same=()
for t in "${types[@]}"; do
  twin=""
  if [ "$t" != unset ] && [ -n "$lib" ]; then
    for r in "${ran[@]}"; do
      [ "$r" = unset ] && continue
      if python3 scripts/openblas_kernels.py "$lib" "$r" "$t" > "$build/sweep-$t.same" 2>&1; then
        twin=$r
        break
      fi
    done
  fi
  if [ -n "$twin" ]; then
    echo "=== OPENBLAS_CORETYPE=$t: not rerun, it computes $twin's bits:"
    sed 's/^/    /' "$build/sweep-$t.same"
    same+=("$t=$twin")
    continue
  fi
  ran+=("$t")
  echo "=== OPENBLAS_CORETYPE=$t"
  if [ "$t" = unset ]; then
    env -u OPENBLAS_CORETYPE ctest --test-dir "$build" -j "$JOBS" --timeout 3000 "${exclude[@]}" \
      --output-on-failure > "$build/sweep-$t.log" 2>&1 || failed+=("$t")
  else
    OPENBLAS_CORETYPE=$t OPENBLAS_VERBOSE=2 ctest --test-dir "$build" -j "$JOBS" \
      --timeout 3000 "${exclude[@]}" --output-on-failure > "$build/sweep-$t.log" 2>&1 || failed+=("$t")
  fi
  tail -n 3 "$build/sweep-$t.log"
  if [[ " ${failed[*]:-} " == *" $t "* ]]; then
    grep -E "Failed|FAIL|\*\*\*" "$build/sweep-$t.log" | head -40 || true
  fi
done
skipped=()
for t in Haswell Zen SkylakeX Cooperlake; do
  [[ " ${types[*]} " == *" $t "* ]] || skipped+=("$t")
done
[ ${#skipped[@]} -eq 0 ] || echo "not run (this CPU lacks the instructions): ${skipped[*]}"
if [ ${#failed[@]} -ne 0 ]; then
  echo "FAILED with OPENBLAS_CORETYPE: ${failed[*]} (logs: $build/sweep-*.log)" >&2
  exit 1
fi
echo "the suite passed with every kernel: ${ran[*]}${same[*]:+ (and, the same bits: ${same[*]})}"
