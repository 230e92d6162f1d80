#!/usr/bin/env bash
# Runs on the GPU machine from the kit (scripts/gpu-pack.sh), after a
# change to the CUDA backend: the three backend suites, FlashBench, GPT-2
# 124M (T=1024) through bench/gpt2_gpu.py beside PyTorch fp32 and bf16
# eager at B=16 (fsdp-run alone at B=32), a per-instruction profile of
# GPT-2 in bf16 and f32 (fsdp-run --trace on cuda: each span the GPU's
# time between events on the compute stream; bf16 once more with
# --trace-sync: each instruction alone), and test/e2e/cuda_emu.py's
# matrix (--gpu), then GPT-2 at B=32 and the FSDP2 tutorial MLP at hidden
# 4096 (bench/mlp_gpu.py). Logs, traces and bench JSON go to $OUT; summarize traces
# here with scripts/trace-summary.py. Prints a summary line per step.
# QUICK=1: no PyTorch runs, no matrix, no B=32 (a short lease).
set -uo pipefail
K="$(cd "$(dirname "$0")" && pwd)"
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=${PY:-/opt/torch/.venv/bin/python3}
SP=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$K/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
P="$K/plans"
fail=0
step() { # name timeout command...: the log in $OUT/name.log
  local name=$1 t=$2 t0=$SECONDS; shift 2
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then echo "$name ok ($((SECONDS - t0)) s)"; else
    echo "$name FAILED (rc $rc, $((SECONDS - t0)) s)"; grep -A3 Failure "$OUT/$name.log" | head -20
    tail -5 "$OUT/$name.log"; fail=1; fi
}
for t in CudaKernelsTest CudaFastKernelsTest DeviceTest; do step "$t" 120 "$K/bin/$t"; done
step FlashBench 60 "$K/bin/FlashBench" && cat "$OUT/FlashBench.log"
step bench_b16 200 "$PY" "$K/bench/gpt2_gpu.py" --fsdp-run "$K/bin/fsdp-run" --plans "$P" \
  --batch 16 --steps 20 --torch-modes fp32,eager --json "$OUT/bench_b16.json" \
  $([ "${QUICK:-0}" = 1 ] && echo --skip-torch)
grep -E "tok/s" "$OUT/bench_b16.log"
# The bf16 GPT-2 step with cuBLASLt tuning, without GEMM staging
# (CudaGemm.h), with the LM head unpadded (pad-classes=0, 50257
# columns: staged GEMMs), and with attention on the WMMA kernels instead
# of the mma.sync ones (CudaFlash.h), and the ZeRO-3 plan at world size 1
# (issue 10: stage 0's speed), for comparison; PyTorch's cuBLAS on the LM
# head's GEMMs at 50257 and 50304 columns.
for v in FSDP_CUDA_GEMM_TUNE=1 FSDP_CUDA_GEMM_STAGING=0 UNPADDED=1 FSDP_CUDA_ATTENTION=wmma ZERO3=1; do
  plan="$P/gpt2_bf16_b16.plan"
  [ "$v" = UNPADDED=1 ] && plan="$P/gpt2_bf16_b16_unpadded.plan"
  [ "$v" = ZERO3=1 ] && plan="$P/gpt2_bf16_b16_zero3.plan"
  step "variant_${v%%=*}" 90 env "$v" "$K/bin/fsdp-run" "$plan" --device cuda \
    --steps 12 --lr 1e-4 --quiet
  echo "$v: $(grep -E "ms/step|tuning" "$OUT/variant_${v%%=*}.log" | tr '\n' ' ')"
done
step lm_head_probe 60 "$PY" "$K/bench/lm_head_probe.py" && cat "$OUT/lm_head_probe.log"
for d in bf16 f32; do
  step "trace_$d" 90 "$K/bin/fsdp-run" "$P/gpt2_${d}_b16.plan" --device cuda --steps 3 --lr 1e-4 \
    --trace "$OUT/trace_$d.json"
done
# The same bf16 step synchronized after every instruction (each op alone):
# the difference to trace_bf16 is what overlap and queueing hide.
step trace_sync_bf16 90 "$K/bin/fsdp-run" "$P/gpt2_bf16_b16.plan" --device cuda --steps 3 \
  --lr 1e-4 --trace "$OUT/trace_sync_bf16.json" --trace-sync
[ "${QUICK:-0}" = 1 ] && exit $fail
step issue9_matrix 240 "$PY" "$K/../test/e2e/cuda_emu.py" "$K/bin" "$PY" --gpu "$P/e2e"
grep -E "ok$|MISMATCH|skipped|match" "$OUT/issue9_matrix.log" | tail -25
# Issue 10: the bf16 GPU run tracks the f32 GPU run and the CPU bf16 run
# (200 steps of the small GPT on text, 50-step windows within D u).
step bf16_text_track 240 "$PY" "$K/../test/e2e/mixed_precision.py" "$K/bin" text "$P/text.bin" \
  --device cuda --plans "$P/text"
grep -E "ok$|MISMATCH|tolerance|pass" "$OUT/bf16_text_track.log"
step bench_b32 120 "$PY" "$K/bench/gpt2_gpu.py" --fsdp-run "$K/bin/fsdp-run" --plans "$P" \
  --batch 32 --steps 20 --skip-torch --json "$OUT/bench_b32.json"
grep -E "tok/s" "$OUT/bench_b32.log"
# The FSDP2 tutorial MLP (hidden 4096, 8 blocks, 1024 rows) beside PyTorch.
step mlp_bench 200 "$PY" "$K/bench/mlp_gpu.py" --fsdp-run "$K/bin/fsdp-run" --plans "$P" \
  --steps 20 --json "$OUT/mlp_bench.json"
grep -E "rows/s" "$OUT/mlp_bench.log"
exit $fail
