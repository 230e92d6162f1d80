#!/usr/bin/env python3
"""reshard-after-backward true | false with gradient accumulation
(docs/BENCHMARKS.md): FSDP2's set_reshard_after_backward(False) keeps each
unit's last gather of a micro-batch for the next micro-batch's forward.

1. Predicted (h100 profile, fsdp-opt simulate=true; not run on a GPU): GPT
   shapes at stage 3, bf16, K micro-batches, reshard-after-forward true and
   false: step (exposed communication), planned peak, all-gathers a step.
2. Measured on this machine's CPU ranks: a GPT (8 layers, width 256) at
   stage 3 on 2 ranks with 4 micro-batches, true and false alternated
   ROUNDS times in one run: median step time, its ratio, bytes moved a
   step and the arena fsdp-run measured (== planned).

  bench/reshard_after_backward.py [--bin build/bin] [--rounds 3] [--steps 12]
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
from budget import GEN, MODELS, ROOT, alternated, gib, model_file, simulate  # noqa: E402

SHAPES = [("gpt2", 8, 4), ("gpt2", 64, 8), ("1.3b", 64, 8), ("7b", 64, 8)]


def predicted(a, tmp):
    print("| model | N | K | reshard-after-forward | reshard-after-backward=true: step ms "
          "(exposed %), peak GiB, gathers | false: step ms (exposed %), peak GiB, gathers | "
          "step ratio |")
    print("|---|---|---|---|---|---|---|")
    for key, n, k in SHAPES:
        label = MODELS[key][0]
        model = model_file(key, tmp)
        for raf in ("true", "false"):
            cells, steps = [], []
            for rab in ("true", "false"):
                plan = os.path.join(tmp, "p.plan")
                step, exp, peak = simulate(a.bin, model,
                                           f"world-size={n} optimizer=adamw stage=3 "
                                           f"param-dtype=bf16 grad-accum={k} "
                                           f"reshard-after-forward={raf} "
                                           f"reshard-after-backward={rab} plan={plan}")
                with open(plan) as f:
                    g = sum(1 for i in json.load(f)["program"] if i["op"] == "all_gather")
                steps.append(step)
                cells.append(f"{step:.1f} ({exp:.1f}), {gib(peak)}, {g}")
            print(f"| {label} | {n} | {k} | {raf} | {cells[0]} | {cells[1]} | "
                  f"x{steps[0] / steps[1]:.3f} |", flush=True)


def measured(a, tmp):
    model = os.path.join(tmp, "gpt8.mlir")
    subprocess.run([sys.executable, GEN, "gpt", "--vocab", "512", "--ctx", "64", "--layers", "8",
                    "--heads", "4", "--width", "256", "--batch", "4", "-o", model], check=True)
    plans = {}
    for rab in ("true", "false"):
        plans[rab] = os.path.join(tmp, f"gpt8-{rab}.plan")
        subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline=world-size=2 optimizer=adamw stage=3 grad-accum=4 "
                        f"reshard-after-backward={rab} plan={plans[rab]} report=false"],
                       check=True)
    times, summary = alternated(a.bin, plans, a.rounds, a.steps)
    print("\n| reshard-after-backward | median step ms per round | vs true (median) | "
          "bytes a step | arena measured (planned) |")
    print("|---|---|---|---|---|")
    ref = statistics.median(times["true"])
    for rab in plans:
        s = summary[rab]
        print(f"| {rab} | {', '.join(f'{t:.2f}' for t in times[rab])} | "
              f"x{statistics.median(times[rab]) / ref:.3f} | {s['comm_bytes_per_step']} | "
              f"{s['measured_high_water']} ({s['predicted_peak']}) |")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        predicted(a, tmp)
        measured(a, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
