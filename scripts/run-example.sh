#!/usr/bin/env bash
# The main job on the embedded default: builds everything, compiles
# examples/mlp.mlir (the FSDP2 tutorial MLP) for ZeRO-3 / FSDP on 4 ranks,
# checks that the GPT-2 small example compiles too, and trains the MLP on 4
# local CPU ranks (Gloo), printing the loss as it falls, the validation
# loss on held-out samples every 50 steps, and the predicted vs measured
# memory per rank. Extra arguments go to fsdp-run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export CCACHE_BASEDIR="$PWD"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/fsdp-ccache}"
cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target fsdp-opt fsdp-run

mkdir -p build/examples
echo "== compiling examples/gpt2.mlir (GPT-2 small, ZeRO-3 on 8 ranks: plan + memory report)"
build/bin/fsdp-opt examples/gpt2.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw world-size=8 stage=3 plan=build/examples/gpt2.plan"
echo "== compiling examples/mlp.mlir for ZeRO-3 on 4 ranks"
build/bin/fsdp-opt examples/mlp.mlir -o /dev/null \
  --fsdp-pipeline="optimizer=adamw world-size=4 stage=3 plan=build/examples/mlp.plan"
echo "== training the MLP on 4 CPU ranks"
build/bin/fsdp-run build/examples/mlp.plan --nproc 4 --threads 1 --steps 200 \
  --lr 1e-3 --log-every 20 --eval-every 50 "$@"
