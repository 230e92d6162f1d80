#!/usr/bin/env bash
# Runs on the GPU machine from the kit (scripts/gpu-pack.sh): where the bf16
# GPT-2 step's time goes, kernel by kernel, with Nsight Compute (ncu; the
# Firecracker machines read the hardware counters, ../.library/device/
# KINDS.md; clocks left alone: --clock-control none).
#   1. every kernel's duration over two steps of GPT-2 124M bf16 at B=16
#      (one pass, no replay): kernels.csv, summed per kernel name here by
#      scripts/ncu-summary.py;
#   2. the attention kernels (FlashBench's shape) and the norm kernels in
#      detail: throughput against the ceilings, occupancy, warp stalls
#      (detail_*.txt).
# Logs go to $OUT/ncu.tgz after each step (the device returns few files).
set -uo pipefail
K="$(cd "$(dirname "$0")" && pwd)"
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
L=$(mktemp -d /tmp/gpu-ncu.XXXXXX)
bundle() { tar czf "$OUT/ncu.tgz.tmp" -C "$L" . && mv "$OUT/ncu.tgz.tmp" "$OUT/ncu.tgz"; }
PY=${PY:-/opt/torch/.venv/bin/python3}
SP=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$K/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
[ -n "$NCU" ] || exit 1
[ -d "$K/bin" ] && [ -d "$K/plans" ] || tar xzf "$K/kit.tgz" -C "$K" # packed by gpu-pack.sh
P="$K/plans"
PLAN=${PLAN:-$P/gpt2_bf16_b16.plan}
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
timeout -k 5 ${T1:-120} "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
  --page raw "$K/bin/fsdp-run" "$PLAN" --device cuda --steps 2 --lr 1e-4 --quiet \
  > "$L/kernels.csv" 2> "$L/kernels.err"
echo "kernels: rc $? $(wc -l < "$L/kernels.csv") lines"; tail -3 "$L/kernels.err"; bundle
for k in forwardMma dqMma dkvMma deltaKernel; do
  timeout -k 5 60 "$NCU" --clock-control none -k "regex:$k" -c 1 $SECTIONS "$K/bin/FlashBench" \
    > "$L/detail_$k.txt" 2>&1
  echo "$k: rc $?"; bundle
done
for k in layerNormGradReg normGradColumns residualLayerNormReg layerNormReg ceGrad ceRow columnSum; do
  timeout -k 5 60 "$NCU" --clock-control none -k "regex:$k" -c 1 $SECTIONS "$K/bin/fsdp-run" "$PLAN" \
    --device cuda --steps 1 --lr 1e-4 --quiet > "$L/detail_$k.txt" 2>&1
  echo "$k: rc $?"; bundle
done
bundle
