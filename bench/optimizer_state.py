#!/usr/bin/env python3
"""Optimizer state in bf16 (optimizer-state-dtype=bf16; docs/BENCHMARKS.md):
AdamW's moments by default, --optimizer sgd (momentum 0.9: its buffer) or
lamb (its moments). --eight: the state in 8-bit block codes
(optimizer-state-dtype=8bit) instead of bf16, against f32 state. --four:
AdamW's moments in 4-bit block codes (optimizer-state-dtype=4bit), against
f32 state (and 8-bit, measured).

1. Predicted (h100 profile, fsdp-opt simulate=true; not run on a GPU):
   planned peak per rank and predicted step with f32 and bf16 moments for
   GPT-2 124M (bf16, B=16, one rank), a 7B shape (bf16, 8 ranks, ZeRO-3,
   unit recomputation) and the 175B shape (bf16, 64 ranks, ZeRO-3, unit
   recomputation), and the ratios to f32 moments.
2. Measured on this machine's CPU ranks: an MLP of 8.4M parameters (hidden
   1024, 8 blocks, batch 8; the update is a large share of its step) on 2
   ranks at stage 3, f32 moments, bf16 stochastic and bf16 nearest
   alternated ROUNDS times: median step time, its ratio to f32, and the
   arena fsdp-run measured (== planned).

  bench/optimizer_state.py [--bin build/bin] [--rounds 3] [--steps 12]
                           [--optimizer adamw|sgd|lamb] [--eight | --four]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from budget import GEN, ROOT, alternated, gib, simulate  # noqa: E402

SHAPES = [
    ("GPT-2 124M, B=16 T=1024, 1 rank", ["--vocab", "50257", "--ctx", "1024", "--layers", "12",
                                         "--heads", "12", "--width", "768", "--batch", "16"],
     "world-size=1 stage=0"),
    ("7B-shaped, T=4096, 8 ranks", ["--vocab", "50257", "--ctx", "4096", "--layers", "32",
                                    "--heads", "32", "--width", "4096", "--batch", "1"],
     "world-size=8 stage=3 recompute=unit"),
    ("175B-shaped, T=2048, 64 ranks", ["--vocab", "50257", "--ctx", "2048", "--layers", "96",
                                       "--heads", "96", "--width", "12288", "--batch", "1"],
     "world-size=64 stage=3 recompute=unit"),
]
OPTIMIZERS = {"adamw": "optimizer=adamw", "sgd": "optimizer=sgd momentum=0.9",
              "lamb": "optimizer=lamb"}
MODES = [("f32 state", ""), ("bf16 stochastic", "optimizer-state-dtype=bf16"),
         ("bf16 nearest", "optimizer-state-dtype=bf16 optimizer-state-rounding=nearest")]
EIGHT = [("f32 state", ""), ("8-bit", "optimizer-state-dtype=8bit")]
FOUR = [("f32 state", ""), ("4-bit", "optimizer-state-dtype=4bit"),
        ("8-bit", "optimizer-state-dtype=8bit")]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip-measured", action="store_true")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    ap.add_argument("--eight", action="store_true", help="8-bit state instead of bf16")
    ap.add_argument("--four", action="store_true", help="AdamW's 4-bit moments instead of bf16")
    a = ap.parse_args()
    if a.four and a.optimizer != "adamw":
        ap.error("--four: 4-bit state is AdamW's moments")
    opt_base = OPTIMIZERS[a.optimizer]
    modes = FOUR if a.four else EIGHT if a.eight else MODES
    other = modes[1][0]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"1. predicted (h100 profile, bf16 compute, {opt_base}): planned peak per rank, "
              f"step")
        for label, args, layout in SHAPES:
            model = os.path.join(tmp, "m.mlir")
            subprocess.run([sys.executable, GEN, "gpt"] + args + ["-o", model], check=True)
            base = f"{opt_base} param-dtype=bf16 device-profile=h100 {layout}"
            rows = [(name, simulate(a.bin, model, f"{base} {opt}")) for name, opt in modes[:2]]
            (_, (s0, _, p0)), (_, (s1, _, p1)) = rows
            print(f"  {label:<34} f32 state {gib(p0)} GiB {s0:9.2f} ms | {other} state "
                  f"{gib(p1)} GiB {s1:9.2f} ms | peak x{p1 / p0:.3f}, step x{s1 / s0:.3f}")
        if a.skip_measured:
            return 0
        model = os.path.join(tmp, "mlp.mlir")
        subprocess.run([sys.executable, GEN, "mlp", "--hidden", "1024", "--blocks", "8",
                        "--batch", "8", "-o", model], check=True)
        plans = {}
        for name, opt in modes:
            plans[name] = os.path.join(tmp, name.replace(" ", "_") + ".plan")
            subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline={opt_base} world-size=2 stage=3 {opt} "
                            f"plan={plans[name]} report=false"], check=True)
        times, summary = alternated(a.bin, plans, a.rounds, a.steps)
        print(f"2. measured: MLP 8.4M parameters, 2 CPU ranks, stage 3, {a.rounds} rounds of "
              f"{a.steps} steps (median step of each round)")
        ref = statistics.median(times["f32 state"])
        for name, _ in modes:
            med = statistics.median(times[name])
            s = summary[name]
            print(f"  {name:<16} {med:8.2f} ms (rounds {', '.join(f'{t:.1f}' for t in times[name])})"
                  f"  x{med / ref:.3f}  arena measured {s['measured_high_water']} == planned "
                  f"{s['predicted_peak']}: {s['measured_high_water'] == s['predicted_peak']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
