#!/usr/bin/env bash
# The runtime under AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer):
# builds build-asan/ (scripts/asan-build.sh: runtime only, clang-19,
# -fsanitize=address,undefined plus the fuzzers' coverage), runs
# every runtime unit test and an end-to-end subset of fsdp-run on plans the
# normal build's fsdp-opt compiles (1 rank and --nproc 2, ZeRO-3 and DDP, MLP
# and a token model, a token file, --init-from / --save round trip, a
# gradient check, bad inputs). Any sanitizer report fails (reports abort:
# -fno-sanitize-recover=all, halt_on_error=1, exitcode 23 checked below).
#
# Usage: scripts/sanitize-check.sh [FSDP_OPT]   (default build/bin/fsdp-opt)
# Called by scripts/test.sh after the normal build. docs/RELIABILITY.md has
# the measured time.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OPT="${1:-build/bin/fsdp-opt}"
export CCACHE_BASEDIR="$PWD"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/fsdp-ccache}"
JOBS="${JOBS:-$(nproc)}"

start=$(date +%s)
bash scripts/asan-build.sh
echo "sanitizer build: $(( $(date +%s) - start )) s"

# Reports exit with 23 so they cannot be confused with an expected error
# exit (1). Suppressions (third-party frames only) are documented in the files.
SUPP="$ROOT/scripts/sanitizers"
export ASAN_OPTIONS="halt_on_error=1:exitcode=23:detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
export UBSAN_OPTIONS="halt_on_error=1:exitcode=23:print_stacktrace=1:suppressions=$SUPP/ubsan.supp"
export LSAN_OPTIONS="exitcode=23:suppressions=$SUPP/lsan.supp:print_suppressions=0"
export OMP_NUM_THREADS=2

t0=$(date +%s)
ctest --test-dir build-asan --output-on-failure -j "$JOBS" --timeout 600
echo "sanitizer unit tests: $(( $(date +%s) - t0 )) s"

# --- end-to-end subset -----------------------------------------------------
t0=$(date +%s)
RUN="$ROOT/build-asan/bin/fsdp-run"
W="$(mktemp -d /tmp/fsdp-asan.XXXXXX)"
trap 'rm -rf "$W"' EXIT
LOG="$W/log"
fail() { echo "sanitize-check: FAILED: $*" >&2; cat "$LOG" >&2 || true; exit 1; }
# Runs fsdp-run; expects exit status $1 (0 or 1); a sanitizer report (23, a
# signal, or a report line) is always a failure.
expect() {
  local want="$1"; shift
  local rc=0
  "$RUN" "$@" >"$LOG" 2>&1 || rc=$?
  if grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:|SUMMARY: .*Sanitizer' "$LOG"; then
    fail "sanitizer report from: fsdp-run $*"
  fi
  [[ "$rc" == "$want" ]] || fail "exit $rc (expected $want) from: fsdp-run $*"
}
compile() { # model.mlir plan "pipeline options"
  "$OPT" "$1" -o /dev/null --fsdp-pipeline="$3 plan=$2 report=false"
}

python3 examples/gen_models.py mlp --hidden 16 --blocks 2 --batch 4 -o "$W/mlp.mlir"
python3 examples/gen_models.py gpt --vocab 32 --ctx 8 --layers 1 --heads 2 \
  --width 16 --batch 2 -o "$W/gpt.mlir"
compile "$W/mlp.mlir" "$W/mlp1.plan" "optimizer=adamw max-grad-norm=1.0"
compile "$W/mlp.mlir" "$W/mlp2z3.plan" "optimizer=adamw world-size=2 stage=3"
compile "$W/mlp.mlir" "$W/mlp2z0.plan" "optimizer=sgd momentum=0.9 world-size=2 stage=0"
compile "$W/mlp.mlir" "$W/mlp4hsdp.plan" "optimizer=adamw world-size=4 stage=3 mesh=2x2"
compile "$W/mlp.mlir" "$W/mlpgrad.plan" "optimizer=none"
compile "$W/gpt.mlir" "$W/gpt2z2.plan" "optimizer=adamw world-size=2 stage=2"
compile "$W/gpt.mlir" "$W/gptgrad.plan" "optimizer=none"
python3 examples/gen_models.py llama --vocab 32 --ctx 8 --layers 1 --heads 4 \
  --kv-heads 2 --width 16 --ffn 24 --batch 2 -o "$W/llama.mlir"
compile "$W/llama.mlir" "$W/llama1.plan" "optimizer=adamw"
compile "$W/llama.mlir" "$W/llama2z3.plan" "optimizer=adamw world-size=2 stage=3"
compile "$W/llama.mlir" "$W/llamagrad.plan" "optimizer=none"

expect 0 "$W/mlp1.plan" --steps 3 --threads 2 --save "$W/a.safetensors"
expect 0 "$W/mlp1.plan" --steps 2 --init-from "$W/a.safetensors" --save "$W/b.safetensors" \
  --dump-dir "$W/dump"
expect 0 "$W/mlp2z3.plan" --nproc 2 --steps 3 --threads 1 --init-from "$W/a.safetensors" \
  --save "$W/c.safetensors" --schedule cosine --warmup 1
expect 0 "$W/mlp2z0.plan" --nproc 2 --steps 3 --threads 1 --json
# Two nodes of two (the hybrid communicator; HSDP groups on shared memory
# and on Gloo).
expect 0 "$W/mlp4hsdp.plan" --nproc 4 --nnodes 2 --steps 3 --threads 1
python3 tools/make_tokens.py --help >/dev/null 2>&1 || true
python3 - "$W/tok.bin" <<'EOF'
import struct, sys
toks = [(7 * i + 3) % 32 for i in range(300)]
hdr = [20240520, 1, len(toks)] + [0] * 253
open(sys.argv[1], "wb").write(struct.pack("<256i", *hdr) + struct.pack("<%dH" % len(toks), *toks))
EOF
expect 0 "$W/gpt2z2.plan" --nproc 2 --steps 3 --threads 1 --data "$W/tok.bin"
# Validation (the step's prefix + the loss's all-reduce) and the weight
# decay split by shard (weight-decay-params=matrices).
expect 0 "$W/gpt2z2.plan" --nproc 2 --steps 3 --threads 1 --data "$W/tok.bin" \
  --eval-every 2 --eval-data "$W/tok.bin" --eval-batches 2
# Gradient-accumulation fusion: the second micro-batch's GEMMs and column
# sums add in place into the first's gradients (matmul and matmul_bias_grad
# with accumulators), f32 at 2 ranks and bf16 products into f32 sums.
compile "$W/gpt.mlir" "$W/gptacc.plan" "optimizer=adamw world-size=2 stage=2 grad-accum=2"
expect 0 "$W/gptacc.plan" --nproc 2 --steps 2 --threads 1 --data "$W/tok.bin"
compile "$W/gpt.mlir" "$W/gptaccbf16.plan" "optimizer=adamw param-dtype=bf16 grad-accum=2"
expect 0 "$W/gptaccbf16.plan" --steps 2 --threads 2 --data "$W/tok.bin"
compile "$W/mlp.mlir" "$W/mlp2wd.plan" "optimizer=adamw weight-decay-params=matrices world-size=2 stage=3"
expect 0 "$W/mlp2wd.plan" --nproc 2 --steps 3 --threads 1 --eval-every 1
expect 0 "$W/mlpgrad.plan" --gradcheck 4 --threads 1
expect 0 "$W/gptgrad.plan" --gradcheck 2 --threads 1
expect 0 "$W/llama2z3.plan" --nproc 2 --steps 3 --threads 2
# Resharding to 2 of 4 ranks (hpZ: rank_period shard views, the reshard
# group's communicator), with an evaluation.
compile "$W/mlp.mlir" "$W/mlp4hpz.plan" "optimizer=adamw world-size=4 stage=3 reshard-after-forward=2"
expect 0 "$W/mlp4hpz.plan" --nproc 4 --steps 3 --threads 1 --eval-every 2
expect 0 "$W/llamagrad.plan" --gradcheck 2 --threads 1
# Optimizer offload: the host arena (master shards, AdamW state, the
# update on the host), 2 ranks at stage 2 with clipping, a checkpoint,
# resume and an evaluation.
compile "$W/mlp.mlir" "$W/mlp2off.plan" "optimizer=adamw world-size=2 stage=2 max-grad-norm=1.0 offload=optimizer"
expect 0 "$W/mlp2off.plan" --nproc 2 --steps 3 --threads 1 --ckpt-dir "$W/offck" --eval-every 2
expect 0 "$W/mlp2off.plan" --nproc 2 --steps 5 --threads 1 --resume "$W/offck"
# The same joined in the next step (offload-next-step): host updates that
# outlive their step, finished for the checkpoint and the evaluation.
compile "$W/mlp.mlir" "$W/mlp2next.plan" "optimizer=adamw world-size=2 stage=3 max-grad-norm=1.0 offload=optimizer offload-next-step=true"
expect 0 "$W/mlp2next.plan" --nproc 2 --steps 3 --threads 1 --ckpt-dir "$W/nextck" --eval-every 2
expect 0 "$W/mlp2next.plan" --nproc 2 --steps 5 --threads 1 --resume "$W/nextck"
# f16 with dynamic loss scaling: f16 reductions, overflowed (skipped) steps
# from a huge initial scale, the scaler's checkpoint and resume.
compile "$W/mlp.mlir" "$W/mlpf16.plan" "optimizer=adamw param-dtype=f16 reduce-dtype=f16 \
  world-size=2 stage=3 max-grad-norm=1.0 loss-scale-init=1180591620717411303424"
expect 0 "$W/mlpf16.plan" --nproc 2 --steps 3 --threads 1 --ckpt-dir "$W/f16ck"
expect 0 "$W/mlpf16.plan" --nproc 2 --steps 5 --threads 1 --resume "$W/f16ck"
# Bad inputs: a clean error, no report.
head -c 700 "$W/mlp1.plan" > "$W/trunc.plan"
expect 1 "$W/trunc.plan"
head -c 300 "$W/a.safetensors" > "$W/trunc.safetensors"
expect 1 "$W/mlp1.plan" --steps 1 --init-from "$W/trunc.safetensors"
expect 1 "$W/mlp1.plan" --steps 1 --init-from "$W/mlp1.plan"
expect 1 "$W/gpt2z2.plan" --nproc 2 --steps 1 --data "$W/mlp1.plan"
expect 1 "$W/mlp1.plan" --nproc 2 --steps 1

# The bad-input table (test/e2e/bad_inputs.py: hostile plans, options, token
# files, checkpoints, environments) against the instrumented fsdp-run: each
# case must still be a clean error, now also without a sanitizer report.
# KNOWN: cases with a reproducer in fuzz/crashes/ awaiting a fix in a file
# this script's owner does not edit; listed so CI stays usable, printed on
# every run, and to be removed here when fixed.
KNOWN=()   # e.g. ("plan: slice offset INT64_MAX"), fixed in 5462d67
compile examples/gpt_small.mlir "$W/gpt_small.plan" "optimizer=adamw max-grad-norm=1.0"
compile examples/gpt_small.mlir "$W/gpt_unfused.plan" "optimizer=adamw fuse-epilogues=false"
compile "$W/mlp.mlir" "$W/mlp2z2.plan" "optimizer=adamw world-size=2 stage=2"
compile "$W/mlp.mlir" "$W/mlp1off.plan" "optimizer=adamw stage=3 offload=optimizer"
compile "$W/mlp.mlir" "$W/mlp1lamb.plan" "optimizer=lamb max-grad-norm=1.0 weight-decay-params=matrices"
compile "$W/mlp.mlir" "$W/mlp1next.plan" "optimizer=adamw stage=3 offload=optimizer max-grad-norm=1.0 offload-next-step=true"
compile "$W/mlp.mlir" "$W/mlp1nvme.plan" "optimizer=adamw stage=3 offload=optimizer offload-nvme=true"
python3 test/e2e/bad_inputs.py build-asan/bin "$W/mlp1.plan" "$W/gpt_small.plan" \
  "$W/mlp2z2.plan" "$W/llama1.plan" "$W/mlp1off.plan" "$W/gpt_unfused.plan" \
  "$W/mlp1lamb.plan" "$W/mlp1next.plan" "$W/mlp1nvme.plan" >"$W/bad.log" 2>&1 || true
grep -q "bad inputs, " "$W/bad.log" || { cat "$W/bad.log" >&2; fail "bad_inputs.py did not run"; }
bad=0
while IFS= read -r line; do
  name="$(sed -E 's/^FAIL +//; s/ +exit .*//' <<<"$line")"
  known=0
  for k in "${KNOWN[@]+"${KNOWN[@]}"}"; do [[ "$name" == "$k" ]] && known=1; done
  if ((known)); then
    echo "sanitize-check: known, not fixed yet: $line"
  else
    echo "sanitize-check: $line" >&2
    bad=1
  fi
done < <(grep '^FAIL ' "$W/bad.log" | grep -v '^FAIL: ' || true)
((bad == 0)) || fail "bad-input cases failed under the sanitizers"
echo "sanitizer bad-input table: $(grep -oE '^[0-9]+ bad inputs, [0-9]+ rejected cleanly' "$W/bad.log")"
# Checkpoints: save, exact resume, a save killed half way, export, bad
# checkpoints (test/e2e/checkpoint.py; a sanitizer report is exit 23, which
# fails every one of its checks).
python3 test/e2e/checkpoint.py build-asan/bin "$W/ckpt" "$OPT" >"$W/ckpt.log" 2>&1 ||
  { cat "$W/ckpt.log" >&2; fail "checkpoint checks failed under the sanitizers"; }
echo "sanitizer checkpoints: $(tail -n 1 "$W/ckpt.log")"
# Checkpoints written by a second thread while training runs
# (test/e2e/async_save.py: the snapshot, the writer, rank 0's wait).
python3 test/e2e/async_save.py build-asan/bin "$W/async" "$OPT" >"$W/async.log" 2>&1 ||
  { cat "$W/async.log" >&2; fail "async-save checks failed under the sanitizers"; }
echo "sanitizer async checkpoints: $(tail -n 1 "$W/async.log")"
echo "sanitizer end-to-end: $(( $(date +%s) - t0 )) s"
echo "sanitize-check: ok, no sanitizer reports ($(( $(date +%s) - start )) s in all)"
