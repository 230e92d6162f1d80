#!/usr/bin/env bash
# The runtime's behaviour over a corpus of runs, for checking that a
# refactor of the runtime changes nothing (plan-corpus.sh's twin): run it
# with the binaries built before the change and with those built after,
# then compare the two folders with `diff -r -b`.
#   1. fsdp-run on the CPU, 16 cases: 2 ranks at stage 3 (plain, --json,
#      --eval-every, --dump-dir + --save, --ckpt-dir with --keep, --resume
#      on and past its end, --trace), f16 with a cosine schedule,
#      --gradcheck, and the option / file errors. Timings are masked; the
#      dump's log and the trace keep everything but times.
#   2. fsdp-run-emu (when BIN_DIR has it: the CUDA backend on the
#      emulator), 9 plans x 3 steps: the losses and the final parameters,
#      which must be bitwise the same (GPT f32 / bf16 / bf16 ZeRO-3 /
#      stochastic rounding / SGD ZeRO-2 with recompute, Llama f32 / bf16,
#      MLP SGD-momentum ZeRO-3 and f16 with loss scaling).
# What may differ between two folders: file:line in messages, and which
# rank reports a failing resume first (a race).
#
# Usage: scripts/run-corpus.sh BIN_DIR OUT_DIR   (BIN_DIR: fsdp-opt,
#   fsdp-run and optionally fsdp-run-emu; about a minute on two cores)
#   e.g. cp build/bin/fsdp-{opt,run,run-emu} /tmp/before/
#        scripts/run-corpus.sh /tmp/before /tmp/runs.before
#        scripts/run-corpus.sh build/bin /tmp/runs.after
#        diff -r -b /tmp/runs.before /tmp/runs.after
set -uo pipefail
BIN=$(cd "$1" && pwd)
M="$(cd "$(dirname "$0")/.." && pwd)/examples"
mkdir -p "$2"
# Paths relative to the output folder, so that the messages naming them
# are the same in two folders.
cd "$2" || exit 1
O=.
P=plans
mkdir -p "$P"
compile() { # name model options
  "$BIN/fsdp-opt" "$M/$2.mlir" -o /dev/null "--fsdp-pipeline=$3 plan=$P/$1.plan report=false" \
    > "$P/$1.out" 2>&1 || echo "compile $1 failed" >&2
}
compile mlp2 mlp "optimizer=adamw world-size=2 stage=3"
compile gptf16 gpt_small "optimizer=adamw world-size=1 stage=0 param-dtype=f16"
compile mlpg mlp "optimizer=none world-size=1 stage=0"

# 1. fsdp-run on the CPU.
mask() {
  sed -E 's/[0-9]+\.[0-9]+ ms/X ms/g; s/"(ms|mean_step_ms)":[0-9.e+-]+/"\1":X/g;
          s/ [0-9]+ (samples|tokens)\/s/ X \1\/s/g; s/"(samples|tokens)_per_s":[0-9.e+-]+/"\1_per_s":X/g'
}
run() { # name args...
  local name=$1
  shift
  ("$BIN/fsdp-run" "$@" > "$O/$name.raw" 2> "$O/$name.err"; echo "rc $?" >> "$O/$name.raw")
  mask < "$O/$name.raw" > "$O/$name.out"
  rm "$O/$name.raw"
}
run plain "$P/mlp2.plan" --nproc 2 --steps 5
run json "$P/mlp2.plan" --nproc 2 --steps 5 --json
run eval "$P/mlp2.plan" --nproc 2 --steps 6 --eval-every 3 --eval-batches 2
run evaljson "$P/mlp2.plan" --nproc 2 --steps 6 --eval-every 3 --json
run dump "$P/mlp2.plan" --nproc 2 --steps 3 --dump-dir "$O/dumpdir" --save "$O/final.safetensors" --quiet
run ckpt "$P/mlp2.plan" --nproc 2 --steps 6 --ckpt-dir "$O/ck" --save-every 2 --keep 2 --log-every 2
run resume "$P/mlp2.plan" --nproc 2 --steps 8 --resume "$O/ck" --lr 2e-3
run resumedone "$P/mlp2.plan" --nproc 2 --steps 6 --resume "$O/ck"
run f16 "$P/gptf16.plan" --steps 4 --schedule cosine --warmup 2
run f16graphs "$P/gptf16.plan" --steps 4 --json --cuda-graphs
run grad "$P/mlpg.plan" --gradcheck 3
run trace "$P/mlp2.plan" --nproc 2 --steps 2 --trace "$O/trace.json" --quiet
run badsave "$P/mlp2.plan" --steps 2 --save /nonexistent/x.safetensors
run calibplan "$P/mlp2.plan" --calibrate
run noplan /nonexistent.plan
# The step times out of the dump's log, the timestamps out of the trace.
python3 - "$O" <<'PY'
import json, os, sys
o = sys.argv[1]
p = os.path.join(o, "dumpdir", "log.json")
if os.path.exists(p):
    d = json.load(open(p))
    d["step_ms"] = len(d["step_ms"])
    json.dump(d, open(p, "w"), sort_keys=True)
p = os.path.join(o, "trace.json")
if os.path.exists(p):
    d = json.load(open(p))
    d["traceEvents"] = sorted(
        (e["name"], e["ph"], e.get("pid"), e.get("tid"), json.dumps(e.get("args"), sort_keys=True))
        for e in d["traceEvents"])
    json.dump(d, open(p, "w"), sort_keys=True)
PY

# 2. The CUDA backend on the emulator.
[ -x "$BIN/fsdp-run-emu" ] || { echo "no fsdp-run-emu in $BIN: the CUDA cases skipped"; exit 0; }
compile gptf32 gpt_small "optimizer=adamw max-grad-norm=1.0"
compile gptbf16 gpt_small "optimizer=adamw param-dtype=bf16 max-grad-norm=1.0"
compile gptbf16z3 gpt_small "optimizer=adamw world-size=2 stage=3 param-dtype=bf16 weight-decay-params=matrices weight-decay=0.1"
compile llamabf16 llama_small "optimizer=adamw param-dtype=bf16"
compile llamaf32 llama_small "optimizer=adamw max-grad-norm=1.0"
compile mlpsgd mlp "optimizer=sgd momentum=0.9 world-size=2 stage=3 max-grad-norm=1.0"
compile mlpf16 mlp "optimizer=adamw param-dtype=f16 loss-scale=dynamic"
compile gptsr gpt_small "optimizer=adamw param-dtype=bf16 stochastic-rounding=true"
compile gptsgd gpt_small "optimizer=sgd world-size=2 stage=2 recompute=unit"
for p in gptf32 gptbf16 gptbf16z3 llamabf16 llamaf32 mlpsgd mlpf16 gptsr gptsgd; do
  np=1
  case $p in gptbf16z3 | mlpsgd | gptsgd) np=2 ;; esac
  "$BIN/fsdp-run-emu" "$P/$p.plan" --device cuda --steps 3 --nproc "$np" --json \
    --save "$O/cuda.$p.safetensors" 2> "$O/cuda.$p.err" |
    python3 -c 'import json, sys; print([json.loads(l).get("loss") for l in sys.stdin if "\"step\"" in l])' \
      > "$O/cuda.$p.losses"
done
