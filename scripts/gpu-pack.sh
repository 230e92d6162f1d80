#!/usr/bin/env bash
# Packs what the GPU machine needs into gpu-kit/ (git-ignored), for the
# device tool's `carry` (../.library/device/README.md): that machine has
# CUDA's driver and PyTorch but no MLIR, no Gloo and no apt. Then run
#   bash gpu-kit/gpu-check.sh      (there; writes logs under $OUT)
# Needs a build with the CUDA backend (build/, FSDP_HAVE_CUDA).
# EMU=1 packs gpu-kit-emu/ instead, with the binaries built on the CPU
# emulation of CUDA (test/cudaemu/) under the same names: a rehearsal of the
# GPU session here (`EMU=1 bash gpu-kit-emu/gpu-check.sh`), the same steps
# less the speed runs.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BUILD:-build}
EMU=${EMU:-0}
OPT=${OPT:-$B/bin/fsdp-opt}
K=gpu-kit
[ "$EMU" = 1 ] && K=gpu-kit-emu
rm -rf "$K" && mkdir -p "$K/bin" "$K/lib" "$K/plans" "$K/oracle"
if [ "$EMU" = 1 ]; then
  cp "$B/bin/fsdp-run-emu" "$K/bin/fsdp-run"
  for t in CudaKernelsTest CudaFastKernelsTest DeviceTest; do
    cp "$B/bin/${t%Test}EmuTest" "$K/bin/$t"
  done
else
  for t in fsdp-run CudaKernelsTest CudaFastKernelsTest DeviceTest FlashBench; do
    cp "$B/bin/$t" "$K/bin/"
  done
fi
# Whether dlopen finds cuBLASLt and NCCL there (runtime/cuda/CudaLibs.h):
# the real libraries in both kits (the emulator's binaries bring their own).
cp "$B/bin/CudaLibsTest" "$K/bin/"
# Gloo and what it pulls in (absent there; 1.5 MB).
for l in libgloo.so.0 libhiredis.so.0.14 libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200; do
  cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')" "$K/lib/"
done
cp test/oracle/torch_ref.py "$K/oracle/"
# The plans of test/lit/e2e/cuda.test, compiled here.
P="$K/plans"
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 plan=$P/gpt.plan report=false"
# The same without fused matmul epilogues: isolates cuBLASLt's epilogues.
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 fuse-epilogues=false plan=$P/gpt_unfused.plan report=false"
python3 examples/gen_models.py llama -o "$P/llama.mlir"
"$OPT" "$P/llama.mlir" -o /dev/null \
  --fsdp-pipeline="optimizer=sgd momentum=0.9 plan=$P/llama.plan report=false"
python3 examples/gen_models.py mlp --hidden 64 --blocks 8 --batch 30 -o "$P/g30.mlir"
python3 examples/gen_models.py mlp --hidden 64 --blocks 8 --batch 15 -o "$P/b15.mlir"
"$OPT" "$P/g30.mlir" -o /dev/null --fsdp-pipeline="optimizer=adamw plan=$P/g30.plan report=false"
"$OPT" "$P/b15.mlir" -o /dev/null \
  --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 plan=$P/n2.plan report=false"
# Optimizer offload: the GPT on one rank (the oracle, both arenas measured)
# and the 2-rank MLP (host-staged, against the n2 plan without offload).
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 stage=3 offload=optimizer plan=$P/gpt_offload.plan report=false"
"$OPT" "$P/b15.mlir" -o /dev/null \
  --fsdp-pipeline="optimizer=adamw world-size=2 stage=3 offload=optimizer plan=$P/n2_offload.plan report=false"
# reshard-after-forward=2 (hpZ) against resharding to all 4 ranks: bitwise
# the same losses (the backward gathers the same bits).
python3 examples/gen_models.py mlp --hidden 64 --blocks 8 --batch 8 -o "$P/b8.mlir"
for rs in true 2; do
  "$OPT" "$P/b8.mlir" -o /dev/null \
    --fsdp-pipeline="optimizer=adamw world-size=4 stage=3 reshard-after-forward=$rs plan=$P/n4_$rs.plan report=false"
done
[ "$EMU" = 1 ] || "$OPT" examples/gpt2.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 plan=$P/gpt2.plan report=false"
# bf16 GPT (small) for the native-vs-widened comparison of gpu-check.sh.
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 param-dtype=bf16 plan=$P/gpt_bf16.plan report=false"
# AdamW's moments in bf16 (optimizer-state-dtype=bf16): the same GPT in
# f32, the GPU against the CPU and the PyTorch oracle on the GPU's dump.
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 optimizer-state-dtype=bf16 plan=$P/gpt_bf16m.plan report=false"
# SGD's momentum buffer and LAMB's moments in bf16, the same way.
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=sgd momentum=0.9 max-grad-norm=1.0 optimizer-state-dtype=bf16 plan=$P/gpt_bf16s.plan report=false"
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=lamb max-grad-norm=1.0 optimizer-state-dtype=bf16 plan=$P/gpt_bf16l.plan report=false"
# AdamW's moments in 8-bit block codes (optimizer-state-dtype=8bit).
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 optimizer-state-dtype=8bit plan=$P/gpt_q8.plan report=false"
# f16 with dynamic loss scaling: the same GPT on the GPU against the CPU.
"$OPT" examples/gpt_small.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw max-grad-norm=1.0 param-dtype=f16 plan=$P/gpt_f16.plan report=false"
# GPT-2 124M at T=1024 for bench/gpt2_gpu.py (the issue's batches: 16, 32).
for b in 16 32; do
  [ "$EMU" = 1 ] && break # no speed runs on the emulator
  python3 examples/gen_models.py gpt --vocab 50257 --ctx 1024 --layers 12 --heads 12 \
    --width 768 --batch $b -o "$P/gpt2_b$b.mlir"
  for d in bf16 f32; do
    [ $d = f32 ] && [ $b = 32 ] && continue # f32 at B=32: over the 80 GB of an H100 with headroom
    "$OPT" "$P/gpt2_b$b.mlir" -o /dev/null \
      --fsdp-pipeline="optimizer=adamw weight-decay=0.1 max-grad-norm=1.0 param-dtype=$d plan=$P/gpt2_${d}_b$b.plan report=false"
  done
  # The LM head unpadded (pad-classes=0: 50257 columns), for comparison;
  # and ZeRO-3 at world size 1 (issue 10: at stage 0's speed).
  [ $b = 16 ] && "$OPT" "$P/gpt2_b$b.mlir" -o /dev/null \
    --fsdp-pipeline="optimizer=adamw weight-decay=0.1 max-grad-norm=1.0 param-dtype=bf16 pad-classes=0 plan=$P/gpt2_bf16_b16_unpadded.plan report=false"
  [ $b = 16 ] && "$OPT" "$P/gpt2_b$b.mlir" -o /dev/null \
    --fsdp-pipeline="optimizer=adamw weight-decay=0.1 max-grad-norm=1.0 param-dtype=bf16 stage=3 plan=$P/gpt2_bf16_b16_zero3.plan report=false"
  # Offload on one GPU (bench/offload_gpu.py, gpu-profile.sh's offload_b16):
  # ZeRO-3 without offload, the optimizer offloaded with its host updates
  # after / beside the backward pass, activations offloaded (copy stream),
  # with and without unit recomputation. No clipping: with it every host
  # update waits for the whole backward pass; the clip pair has it, with
  # the updates joined in their step and in the next (offload-next-step),
  # and in the next with 4 copies to the device in flight.
  if [ $b = 16 ]; then
    ob="optimizer=adamw weight-decay=0.1 param-dtype=bf16 stage=3 report=false"
    for v in "none:" "serial:offload=optimizer offload-overlap=false" \
             "overlap:offload=optimizer" "acts:offload-activations=true" \
             "acts_unit:recompute=unit offload-activations=true" \
             "clip:offload=optimizer max-grad-norm=1.0" \
             "clip_next:offload=optimizer max-grad-norm=1.0 offload-next-step=true" \
             "clip_next_d4:offload=optimizer max-grad-norm=1.0 offload-next-step=true offload-prefetch-depth=4" \
             "nvme:offload=optimizer offload-nvme=true" \
             "nvmep:offload=optimizer offload-nvme=true offload-nvme-params=true"; do
      "$OPT" "$P/gpt2_b$b.mlir" -o /dev/null \
        --fsdp-pipeline="$ob ${v#*:} plan=$P/offload_${v%%:*}.plan"
    done
  fi
  rm -f "$P/gpt2_b$b.mlir"
done
# The FSDP2 tutorial MLP at hidden 4096 for bench/mlp_gpu.py (issue 10).
if [ "$EMU" != 1 ]; then
  python3 examples/gen_models.py mlp --hidden 4096 --blocks 8 --batch 1024 -o "$P/mlp_h4096.mlir"
  for d in bf16 f32; do
    "$OPT" "$P/mlp_h4096.mlir" -o /dev/null \
      --fsdp-pipeline="optimizer=adamw param-dtype=$d plan=$P/mlp_${d}_h4096_b1024.plan report=false"
  done
  rm -f "$P/mlp_h4096.mlir"
fi
# A Llama of about 0.95B parameters in bf16 (rms_norm, rope, SwiGLU native;
# no Llama step has run on a GPU yet): gpu-profile.sh's llama_bf16 step.
if [ "$EMU" != 1 ]; then
  python3 examples/gen_models.py llama --vocab 32000 --ctx 2048 --layers 16 --heads 16 \
    --kv-heads 16 --width 2048 --ffn 5632 --batch 4 -o "$P/llama1b.mlir"
  "$OPT" "$P/llama1b.mlir" -o /dev/null \
    --fsdp-pipeline="optimizer=adamw weight-decay=0.1 max-grad-norm=1.0 param-dtype=bf16 plan=$P/llama1b_bf16.plan report=false"
  rm -f "$P/llama1b.mlir"
fi
# Issue 10's bf16-vs-f32 track on the GPU: the small GPT on text tokens
# (llm.c format, the GPL-3 text every Debian system ships), 200 steps,
# test/e2e/mixed_precision.py text --device cuda (plans compiled here).
python3 tools/make_tokens.py /usr/share/common-licenses/GPL-3 -o "$P/text.bin" > /dev/null
python3 test/e2e/mixed_precision.py "$B/bin" text "$P/text.bin" --compile-only "$P/text" > /dev/null
# test/e2e/cuda_emu.py's plans (issue 9's matrix: cpu-vs-cuda, features,
# checkpoint resume, stages 0-3 at N = 2, 3, 4 host-staged, bf16 oracle),
# run there by gpu-check.sh with --gpu.
python3 test/e2e/cuda_emu.py "$B/bin" /usr/bin/python3 --compile-only "$P/e2e" > /dev/null
mkdir -p "$K/bench" && cp bench/gpt2_gpu.py bench/lm_head_probe.py bench/mlp_gpu.py \
  bench/offload_gpu.py "$K/bench/"
mkdir -p "$K/tools" && cp tools/fsdp-sim/fsdp-sim "$K/tools/" # the cost model, for offload_gpu.py
cp scripts/gpu-check.sh scripts/gpu-profile.sh scripts/gpu-ncu.sh scripts/ncu-summary.py "$K/"
# The device tool carries at most 64 MiB: the binaries without their
# symbol tables (their CUDA fat binaries, about 12 MB each, stay), and a
# clear failure here rather than a refused carry there.
strip --strip-unneeded "$K"/bin/*
# The binaries (62 MB stripped on 2026-12-06, 2 MB under the limit;
# 22 MB compressed) and the plans (JSON, about 8 MB, a tenth of that
# compressed) travel packed, and gpu-check.sh / gpu-profile.sh /
# gpu-ncu.sh unpack them there.
tar czf "$K/kit.tgz" -C "$K" bin plans && rm -rf "$K/bin" "$K/plans"
bytes=$(du -sb "$K" | cut -f1)
echo "$K: $((bytes / 1048576)) MiB ($bytes bytes)"
if [ "$bytes" -gt $((64 * 1048576)) ]; then
  echo "gpu-pack: $K is over the device tool's 64 MiB carry limit" >&2
  exit 1
fi
