#!/usr/bin/env python3
"""Host collectives: shared memory (`--comm shm`) against Gloo over TCP
loopback (`--comm gloo`), same plans, same machine, one run.

For N = 2, 4: (1) the link each communicator gives `fsdp-run --calibrate
--nproc N` (alpha = per-collective latency, beta = seconds per byte, fitted
to all-reduces and all-gathers of 64 B .. 2 MiB, timed as a training step
sees them); (2) ms/step of the MLP (examples/mlp.mlir's shape) and the
small GPT of bench/simulator.py, stage 3, AdamW, 1 thread per rank: runs
alternate between the two communicators, each figure the median over
ROUNDS runs of the median of steps 3..STEPS; (3) the losses of the two are
compared (equal up to the summation order).

  bench/comm.py BIN_DIR [--ranks 2,4] [--steps 30] [--rounds 3]
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
from simulator import GEN, MODELS  # noqa: E402  (the same two models)
COMMS = ("gloo", "shm")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    b = lambda t: os.path.join(a.bindir, t)
    ranks = [int(x) for x in a.ranks.split(",")]
    print(f"{'N':>2} {'comm':>5} {'alpha us':>9} {'GB/s (1/beta)':>14}")
    for n in ranks:
        for c in COMMS:
            p = json.loads(subprocess.run(
                [b("fsdp-run"), "--calibrate", "--threads", "1", "--nproc", str(n), "--comm", c],
                check=True, capture_output=True, text=True).stdout)["link"]
            bw = 1e-9 / p["beta_s_per_byte"] if p["beta_s_per_byte"] > 0 else float("inf")
            print(f"{n:>2} {c:>5} {p['alpha_s'] * 1e6:>9.1f} {bw:>14.2f}")
    print()
    print(f"{'model':>5} {'N':>2} {'gloo ms':>9} {'shm ms':>9} {'speedup':>8} {'max loss rel diff':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in MODELS.items():
            model = os.path.join(tmp, name + ".mlir")
            subprocess.run([sys.executable, GEN] + args + ["-o", model], check=True)
            for n in ranks:
                plan = os.path.join(tmp, f"{name}{n}.plan")
                subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer=adamw stage=3 world-size={n} "
                                f"plan={plan} report=false"], check=True)
                ms = {c: [] for c in COMMS}
                losses = {}
                for _ in range(a.rounds):
                    for c in COMMS:
                        out = subprocess.run(
                            [b("fsdp-run"), plan, "--nproc", str(n), "--threads", "1",
                             "--steps", str(a.steps), "--json", "--comm", c],
                            check=True, capture_output=True, text=True).stdout
                        rows = [json.loads(l) for l in out.splitlines() if '"step"' in l]
                        rows = [r for r in rows if not r.get("summary") and not r.get("eval")]
                        ms[c].append(statistics.median(r["ms"] for r in rows[2:]))
                        losses[c] = [r["loss"] for r in rows]
                g, s = statistics.median(ms["gloo"]), statistics.median(ms["shm"])
                diff = max(abs(x - y) / abs(x) for x, y in zip(losses["gloo"], losses["shm"]))
                print(f"{name:>5} {n:>2} {g:>9.2f} {s:>9.2f} {g / s:>7.2f}x {diff:>18.2e}")


if __name__ == "__main__":
    main()
