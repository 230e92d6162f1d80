#!/usr/bin/env python3
"""The LM head and its loss in row chunks (loss-chunks, fsdp-chunk-loss;
docs/BENCHMARKS.md): Liger-Kernel's fused linear cross-entropy, compiled.

1. Predicted (h100 profile, bf16, fsdp-opt simulate=true; not run on a
   GPU): GPT-2 124M at B=32, T=1024 on one rank (issue 10's anchor, 32768
   tokens a step), and a Llama-3-8B-shaped model (vocabulary 128256, width
   4096, 32 layers, GQA 8 kv heads, FFN 14336) at T=8192 on 8 ranks at
   stage 3 with unit recomputation: planned peak per rank and predicted
   step for loss-chunks = 1, 4, 16 and auto, and the ratios to 1.
2. Measured on this machine's CPU ranks: a GPT with a vocabulary of 16384
   (width 128, 4 layers, 16 x 64 tokens) on 2 ranks at stage 3,
   loss-chunks 1 and auto alternated ROUNDS times in one run: median step
   time, its ratio, and the arena fsdp-run measured (== planned).

  bench/chunk_loss.py [--bin build/bin] [--rounds 3] [--steps 8]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from budget import GEN, ROOT, alternated, gib, simulate  # noqa: E402

SHAPES = [
    ("GPT-2 124M, B=32 T=1024, 1 rank", "gpt",
     ["--vocab", "50257", "--ctx", "1024", "--layers", "12", "--heads", "12", "--width", "768",
      "--batch", "32"], "world-size=1 stage=0"),
    ("Llama-3-8B-shaped, T=8192, 8 ranks", "llama",
     ["--vocab", "128256", "--ctx", "8192", "--layers", "32", "--heads", "32", "--kv-heads", "8",
      "--width", "4096", "--ffn", "14336", "--batch", "1"],
     "world-size=8 stage=3 recompute=unit"),
]
CHUNKS = ["1", "4", "16", "auto"]


def predicted(a, tmp):
    print("| model | loss-chunks | chunks x rows | peak GiB / rank | step ms | peak vs 1 | "
          "step vs 1 |")
    print("|---|---|---|---|---|---|---|")
    for i, (label, kind, args, pipeline) in enumerate(SHAPES):
        model = os.path.join(tmp, f"m{i}.mlir")
        subprocess.run([sys.executable, GEN, kind] + args + ["-o", model], check=True)
        base = None
        for k in CHUNKS:
            plan = os.path.join(tmp, f"m{i}-{k}.plan")
            step, _, peak = simulate(a.bin, model, f"optimizer=adamw param-dtype=bf16 "
                                     f"device-profile=h100 {pipeline} loss-chunks={k} "
                                     f"plan={plan}")
            with open(plan) as f:
                p = json.load(f)
            rows = [p["buffers"][x["in"][0]]["shape"][0] for x in p["program"]
                    if x["op"] == "cross_entropy_fused"]
            base = base or (peak, step)
            print(f"| {label} | {k} | {len(rows)} x {max(rows)} | {gib(peak)} | {step:.1f} | "
                  f"x{peak / base[0]:.3f} | x{step / base[1]:.3f} |")


def measured(a, tmp):
    model = os.path.join(tmp, "vocab.mlir")
    subprocess.run([sys.executable, GEN, "gpt", "--vocab", "16384", "--ctx", "64", "--layers",
                    "4", "--heads", "2", "--width", "128", "--batch", "16", "-o", model],
                   check=True)
    plans = {}
    for k in ("1", "auto"):
        plans[k] = os.path.join(tmp, f"v-{k}.plan")
        subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline=world-size=2 stage=3 optimizer=adamw loss-chunks={k} "
                        f"plan={plans[k]} report=false"], check=True)
    times, summary = alternated(a.bin, plans, a.rounds, a.steps)
    print("\n| loss-chunks | median step ms per round | vs 1 (median) | arena measured "
          "(planned) | vs 1 |")
    print("|---|---|---|---|---|")
    ref = statistics.median(times["1"])
    for k in plans:
        s = summary[k]
        print(f"| {k} | {', '.join(f'{t:.1f}' for t in times[k])} | "
              f"x{statistics.median(times[k]) / ref:.3f} | {s['measured_high_water']} "
              f"({s['predicted_peak']}) | "
              f"x{s['measured_high_water'] / summary['1']['measured_high_water']:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        predicted(a, tmp)
        measured(a, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
