#!/usr/bin/env bash
# Runs on the GPU machine from the kit (scripts/gpu-pack.sh): the three
# backend suites, then a per-instruction profile of GPT-2 124M (B=16,
# T=1024) in bf16 and f32: fsdp-run --trace on cuda synchronizes after
# every instruction, so each span is the GPU's time. Traces and logs go to
# $OUT; summarize here with scripts/trace-summary.py.
set -uo pipefail
K="$(cd "$(dirname "$0")" && pwd)"
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=${PY:-/opt/torch/.venv/bin/python3}
SP=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$K/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
fail=0
for t in CudaKernelsTest CudaFastKernelsTest DeviceTest; do
  timeout 120 "$K/bin/$t" > "$OUT/$t.log" 2>&1 && echo "$t ok" || { echo "$t FAILED"; grep -A3 Failure "$OUT/$t.log" | head -30; fail=1; }
done
for d in bf16 f32; do
  timeout 120 "$K/bin/fsdp-run" "$K/plans/gpt2_${d}_b16.plan" --device cuda --steps 3 --lr 1e-4 \
    --trace "$OUT/trace_$d.json" > "$OUT/trace_$d.log" 2>&1 || { echo "trace $d FAILED"; tail -5 "$OUT/trace_$d.log"; fail=1; }
  tail -2 "$OUT/trace_$d.log"
done
exit $fail
