#!/usr/bin/env bash
# The compiler's output over a corpus of models and option sets, for
# checking that a refactor of a pass changes nothing: run it with the
# fsdp-opt built before the change and with the one built after, then
# compare the two folders (every lowered module, plan file and message
# must be byte-identical; an option set that fails must fail the same way).
#
# Usage: scripts/plan-corpus.sh BIN_DIR OUT_DIR
#   e.g. cp build/bin/fsdp-opt /tmp/before/   (before the change)
#        scripts/plan-corpus.sh /tmp/before /tmp/corpus.before
#        scripts/plan-corpus.sh build/bin /tmp/corpus.after
#        diff -r /tmp/corpus.before /tmp/corpus.after && echo identical
# The three example models x the option sets below, plus GPT-2 twice:
# 158 compiles, a few seconds on two cores.
set -uo pipefail
BIN=$1
OUT=$2
M="$(cd "$(dirname "$0")/.." && pwd)/examples"
mkdir -p "$OUT"
opts=(
  # stages, meshes, resharding
  "optimizer=adamw world-size=1 stage=0"
  "optimizer=adamw world-size=4 stage=0"
  "optimizer=adamw world-size=4 stage=1"
  "optimizer=adamw world-size=4 stage=2"
  "optimizer=adamw world-size=4 stage=3"
  "optimizer=adamw world-size=3 stage=3 reshard-after-forward=false"
  "optimizer=adamw world-size=8 stage=3 reshard-after-forward=2"
  "optimizer=adamw world-size=4 stage=3 mesh=2x2"
  "optimizer=adamw world-size=4 stage=1 mesh=2x2"
  "optimizer=adamw world-size=4 stage=3 param-dtype=bf16 weight-quantization=int8"
  "optimizer=adamw world-size=3 stage=3 gradient-quantization=int8 weight-quantization=int8"
  "optimizer=adamw world-size=8 stage=2 mesh=2x4 gradient-quantization=int8 ranks-per-node=2"
  "optimizer=adamw world-size=4 stage=3 reshard-units=1"
  # optimizers
  "optimizer=sgd momentum=0.9 world-size=2 stage=3 max-grad-norm=1.0"
  "optimizer=sgd world-size=2 stage=2"
  # precision
  "optimizer=adamw world-size=4 stage=3 param-dtype=bf16"
  "optimizer=adamw world-size=4 stage=3 param-dtype=bf16 reduce-dtype=bf16"
  "optimizer=adamw world-size=4 stage=1 param-dtype=bf16"
  "optimizer=adamw world-size=4 stage=2 param-dtype=bf16 max-grad-norm=1.0"
  "optimizer=adamw world-size=4 stage=3 param-dtype=f16 loss-scale=dynamic"
  "optimizer=adamw world-size=2 stage=3 param-dtype=bf16 stochastic-rounding=true"
  # accumulation, recomputation, offload, units, overlap
  "optimizer=adamw world-size=4 stage=3 grad-accum=2"
  "optimizer=adamw world-size=4 stage=3 grad-accum=2 accum-reduce=microbatch"
  "optimizer=adamw world-size=4 stage=3 recompute=unit"
  "optimizer=adamw world-size=4 stage=3 recompute=selective param-dtype=bf16"
  "optimizer=adamw world-size=4 stage=3 offload=optimizer"
  "optimizer=adamw world-size=4 stage=3 offload-activations=true"
  "optimizer=adamw world-size=4 stage=3 weight-decay-params=matrices weight-decay=0.1"
  "optimizer=lamb world-size=4 stage=3 weight-decay-params=matrices max-grad-norm=1.0"
  "optimizer=lamb world-size=4 stage=2 mesh=2x2 param-dtype=bf16 offload=optimizer"
  "optimizer=adamw world-size=4 stage=3 unit-policy=size min-unit-numel=1000"
  "optimizer=adamw world-size=4 stage=3 prefetch=false overlap=false"
  "optimizer=adamw world-size=1 stage=3 param-dtype=bf16 max-grad-norm=1.0"
  "optimizer=adamw world-size=8 stage=3 mesh=2x4 reshard-after-forward=2 param-dtype=bf16"
  # the schedule search (feasible, per-unit walks, infeasible) and simulate
  "optimizer=adamw world-size=4 stage=3 memory-budget=2MiB"
  "optimizer=adamw world-size=4 stage=3 memory-budget=1GiB param-dtype=bf16"
  "optimizer=adamw world-size=4 stage=3 simulate=true"
  "optimizer=adamw world-size=4 stage=3 memory-budget=5MiB"
  "optimizer=adamw world-size=4 stage=3 memory-budget=5500KiB"
  "optimizer=adamw world-size=4 stage=3 memory-budget=6MiB offload-activations=auto"
  "optimizer=adamw world-size=4 stage=3 memory-budget=4MiB recompute=unit"
  "optimizer=adamw world-size=8 stage=3 mesh=2x4 memory-budget=5MiB param-dtype=bf16"
  "optimizer=adamw world-size=2 stage=3 offload=auto memory-budget=3MiB"
  # option errors
  "optimizer=adamw world-size=0 stage=3"
  "optimizer=adamw world-size=4 stage=3 mesh=3x2"
  "optimizer=adamw world-size=4 stage=3 reshard-after-forward=3"
  "optimizer=adamw world-size=4 stage=3 reshard-units=-2"
  "optimizer=adamw world-size=4 stage=3 offload=foo"
  "optimizer=none world-size=4 stage=3"
  "optimizer=adamw world-size=4 stage=3 memory-budget=abc"
  "optimizer=adamw world-size=4 stage=3 memory-budget=1GiB recompute=bad"
  "optimizer=adamw world-size=4 stage=3 memory-budget=1GiB offload-activations=maybe"
)
i=0
for m in mlp gpt_small llama_small; do
  for o in "${opts[@]}"; do
    i=$((i + 1))
    f="$OUT/$m.$i"
    # Messages name the model's path: the same in both runs.
    "$BIN/fsdp-opt" "$M/$m.mlir" -o "$f.mlir" "--fsdp-pipeline=$o plan=$f.plan" > "$f.out" 2>&1
    echo "rc $?" >> "$f.out"
  done
done
for o in "optimizer=adamw world-size=8 stage=3 param-dtype=bf16" \
  "optimizer=adamw world-size=1 stage=0 param-dtype=bf16 max-grad-norm=1.0"; do
  i=$((i + 1))
  f="$OUT/gpt2.$i"
  "$BIN/fsdp-opt" "$M/gpt2.mlir" -o "$f.mlir" "--fsdp-pipeline=$o plan=$f.plan" > "$f.out" 2>&1
  echo "rc $?" >> "$f.out"
done
echo "plan-corpus: $i compiles into $OUT"
