#!/usr/bin/env bash
# The main job on the embedded default: builds everything, compiles
# examples/mlp.mlir (the FSDP2 tutorial MLP) into a plan, checks that the
# GPT-2 example compiles too, and trains the MLP on the CPU, printing the
# loss as it falls. Extra arguments go to fsdp-run (e.g. --steps 300).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export CCACHE_BASEDIR="$PWD"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/fsdp-ccache}"
cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target fsdp-opt fsdp-run

mkdir -p build/examples
echo "== compiling examples/gpt2.mlir (GPT-2 small, verify + plan)"
build/bin/fsdp-opt examples/gpt2.mlir \
  --fsdp-pipeline="optimizer=adamw plan=build/examples/gpt2.plan" -o /dev/null
echo "== compiling examples/mlp.mlir"
build/bin/fsdp-opt examples/mlp.mlir \
  --fsdp-pipeline="optimizer=adamw plan=build/examples/mlp.plan" -o /dev/null
echo "== training the MLP on the CPU"
build/bin/fsdp-run build/examples/mlp.plan --steps 200 --lr 1e-3 "$@"
