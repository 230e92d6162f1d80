#!/usr/bin/env bash
# Runs on the GPU machine from the kit (scripts/gpu-pack.sh), after a
# change to the CUDA backend. A lent GPU now comes with 15 minutes of
# device time in all (the machine's start included) and at most 10 minutes
# a command, so the steps run in order of what matters, inside a time
# budget (BUDGET seconds, default 480): a step whose time limit no longer
# fits is skipped and named ("skipped (budget)"), and everything a step
# wrote is already under $OUT when the budget ends.
#   1. the three backend suites (every kernel against the CPU kernels);
#   2. GPT-2 124M (T=1024) bf16 at B=32, eager and as a CUDA graph (the
#      issue-10 headline; fsdp-run alone, PyTorch's anchors in the issue);
#   3. FlashBench (the attention kernels at GPT-2's shape);
#   4. a device-timed per-instruction trace of the bf16 step at B=16;
#   5. GPT-2 at B=16, fsdp-run bf16 and f32 beside PyTorch fp32 and bf16
#      eager (issue 9's f32 ratio);
#   6. variants of the bf16 step (cuBLASLt tuning, no GEMM staging, the LM
#      head unpadded, WMMA attention, ZeRO-3 at world size 1);
#   7. the f32 trace and the bf16 trace synchronized after each op;
#   8. test/e2e/cuda_emu.py's matrix (--gpu) and the bf16-vs-f32 text track;
#   9. PyTorch bf16 + torch.compile at B=32 side by side; the FSDP2
#      tutorial MLP at hidden 4096 (bench/mlp_gpu.py); the LM-head probe;
#  10. a ~0.95B Llama in bf16, 10 steps (its first GPU run).
# Summarize traces here with scripts/trace-summary.py.
# QUICK=1: steps 1-4 only.
set -uo pipefail
K="$(cd "$(dirname "$0")" && pwd)"
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=${PY:-/opt/torch/.venv/bin/python3}
SP=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$K/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
P="$K/plans"
BUDGET=${BUDGET:-480}
fail=0
step() { # name limit command...: the log in $OUT/name.log; skipped when
  # less than the step's limit is left of the budget
  local name=$1 t=$2 t0=$SECONDS; shift 2
  if [ $((SECONDS + t)) -gt "$BUDGET" ]; then
    echo "$name skipped (budget: $((BUDGET - SECONDS)) s left, needs up to $t s)"
    return 2
  fi
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then echo "$name ok ($((SECONDS - t0)) s)"; else
    echo "$name FAILED (rc $rc, $((SECONDS - t0)) s)"; grep -A3 Failure "$OUT/$name.log" | head -20
    tail -5 "$OUT/$name.log"; fail=1; fi
  return $rc
}
nvidia-smi -L > "$OUT/gpu.txt" 2>&1; cat "$OUT/gpu.txt"
for t in CudaKernelsTest CudaFastKernelsTest DeviceTest; do step "$t" 90 "$K/bin/$t"; done
step bench_b32 100 "$PY" "$K/bench/gpt2_gpu.py" --fsdp-run "$K/bin/fsdp-run" --plans "$P" \
  --batch 32 --steps 20 --skip-torch --json "$OUT/bench_b32.json" && grep -E "tok/s" "$OUT/bench_b32.log"
step FlashBench 45 "$K/bin/FlashBench" && cat "$OUT/FlashBench.log"
step trace_bf16 60 "$K/bin/fsdp-run" "$P/gpt2_bf16_b16.plan" --device cuda --steps 3 --lr 1e-4 \
  --trace "$OUT/trace_bf16.json"
[ "${QUICK:-0}" = 1 ] && exit $fail
step bench_b16 150 "$PY" "$K/bench/gpt2_gpu.py" --fsdp-run "$K/bin/fsdp-run" --plans "$P" \
  --batch 16 --steps 20 --torch-modes fp32,eager --json "$OUT/bench_b16.json" &&
  grep -E "tok/s" "$OUT/bench_b16.log"
# The bf16 GPT-2 step with cuBLASLt tuning, without GEMM staging
# (CudaGemm.h), with the LM head unpadded (pad-classes=0, 50257
# columns: staged GEMMs), and with attention on the WMMA kernels instead
# of the mma.sync ones (CudaFlash.h), and the ZeRO-3 plan at world size 1
# (issue 10: stage 0's speed), for comparison.
for v in FSDP_CUDA_GEMM_TUNE=1 ZERO3=1 FSDP_CUDA_GEMM_STAGING=0 UNPADDED=1 FSDP_CUDA_ATTENTION=wmma; do
  plan="$P/gpt2_bf16_b16.plan"
  [ "$v" = UNPADDED=1 ] && plan="$P/gpt2_bf16_b16_unpadded.plan"
  [ "$v" = ZERO3=1 ] && plan="$P/gpt2_bf16_b16_zero3.plan"
  step "variant_${v%%=*}" 45 env "$v" "$K/bin/fsdp-run" "$plan" --device cuda \
    --steps 12 --lr 1e-4 --quiet && echo "$v: $(grep -E "ms/step|tuning" "$OUT/variant_${v%%=*}.log" | tr '\n' ' ')"
done
step trace_f32 60 "$K/bin/fsdp-run" "$P/gpt2_f32_b16.plan" --device cuda --steps 3 --lr 1e-4 \
  --trace "$OUT/trace_f32.json"
# The same bf16 step synchronized after every instruction (each op alone):
# the difference to trace_bf16 is what overlap and queueing hide.
step trace_sync_bf16 60 "$K/bin/fsdp-run" "$P/gpt2_bf16_b16.plan" --device cuda --steps 3 \
  --lr 1e-4 --trace "$OUT/trace_sync_bf16.json" --trace-sync
step issue9_matrix 200 "$PY" "$K/../test/e2e/cuda_emu.py" "$K/bin" "$PY" --gpu "$P/e2e"
grep -E "ok$|MISMATCH|skipped|match" "$OUT/issue9_matrix.log" | tail -25
# Issue 10: the bf16 GPU run tracks the f32 GPU run and the CPU bf16 run
# (200 steps of the small GPT on text, 50-step windows within D u).
step bf16_text_track 150 "$PY" "$K/../test/e2e/mixed_precision.py" "$K/bin" text "$P/text.bin" \
  --device cuda --plans "$P/text" &&
  grep -E "ok$|MISMATCH|tolerance|pass" "$OUT/bf16_text_track.log"
step torch_compile_b32 180 "$PY" "$K/bench/gpt2_gpu.py" --fsdp-run "$K/bin/fsdp-run" --plans "$P" \
  --batch 32 --steps 20 --torch-modes compile --json "$OUT/torch_compile_b32.json" &&
  grep -E "tok/s" "$OUT/torch_compile_b32.log"
# The FSDP2 tutorial MLP (hidden 4096, 8 blocks, 1024 rows) beside PyTorch.
step mlp_bench 150 "$PY" "$K/bench/mlp_gpu.py" --fsdp-run "$K/bin/fsdp-run" --plans "$P" \
  --steps 20 --json "$OUT/mlp_bench.json" && grep -E "rows/s" "$OUT/mlp_bench.log"
step lm_head_probe 45 "$PY" "$K/bench/lm_head_probe.py" && cat "$OUT/lm_head_probe.log"
# A Llama (~0.95B, bf16, B=4, T=2048): its first GPU steps (tokens/s, the
# arena measured == predicted), last so it never costs the GPT-2 numbers.
step llama_bf16 60 "$K/bin/fsdp-run" "$P/llama1b_bf16.plan" --device cuda --steps 10 \
  --lr 1e-4 --log-every 5 && tail -4 "$OUT/llama_bf16.log"
exit $fail
