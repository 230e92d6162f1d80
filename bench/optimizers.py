#!/usr/bin/env python3
"""What LAMB costs over AdamW, measured side by side in one run.

LAMB (optimizer=lamb) adds, per step, one extra pass over every unit's
shard (fsdp.lamb_norms: the sums of p^2 and u^2 per parameter), the
trust-ratio scaling in the update, and at N > 1 one small all-reduce per
unit (two floats per parameter) over the shard group. This compiles the
same GPT with AdamW and with LAMB (both with clipping, weight decay 0.1
on matrices only), runs them alternately R times for S steps on N CPU
ranks (ZeRO-3 when N > 1), and prints the median step time of each, their
ratio, and the bytes each rank sends per step. It also prints the
per-element costs of the three update kernels from `fsdp-run --calibrate`
(one thread), the part of the step the optimizer is.

  bench/optimizers.py BIN_DIR [--ranks 1,2] [--steps 8] [--repeats 3]
                      [--layers 4] [--width 256] [--threads 1]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(os.path.dirname(HERE), "examples", "gen_models.py")
COMMON = "max-grad-norm=1.0 weight-decay=0.1 weight-decay-params=matrices"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    opt, run = os.path.join(a.bindir, "fsdp-opt"), os.path.join(a.bindir, "fsdp-run")
    cal = json.loads(subprocess.run([run, "--calibrate", "--threads", "1"], check=True,
                                    capture_output=True, text=True).stdout)
    per = cal["compute"]["seconds_per_unit"]
    adamw = per["adamw_update"] * 1e9
    lamb = (per["lamb_norms"] + per["lamb_update"]) * 1e9
    print(f"update kernels, ns per element (fsdp-run --calibrate, 1 thread): adamw_update "
          f"{adamw:.2f}; lamb_norms {per['lamb_norms'] * 1e9:.2f} + lamb_update "
          f"{per['lamb_update'] * 1e9:.2f} = {lamb:.2f} ({lamb / adamw:.2f}x)")
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.ranks.split(",")]:
            model = os.path.join(tmp, f"gpt{n}.mlir")
            subprocess.run([sys.executable, GEN, "gpt", "--vocab", "512", "--ctx", "64",
                            "--layers", str(a.layers), "--heads", "4", "--width",
                            str(a.width), "--batch", str(8 // n), "-o", model], check=True)
            times, comm = {}, {}
            for name in ("adamw", "lamb"):
                plan = os.path.join(tmp, f"{name}{n}.plan")
                subprocess.run([opt, model, "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer={name} {COMMON} world-size={n} "
                                f"stage={3 if n > 1 else 0} plan={plan} report=false"],
                               check=True)
                times[name] = []
            for _ in range(a.repeats):  # alternate, so drift hits both alike
                for name in times:
                    cmd = [run, os.path.join(tmp, f"{name}{n}.plan"), "--steps", str(a.steps),
                           "--json", "--threads", str(a.threads), "--lr", "1e-3"]
                    if n > 1:
                        cmd += ["--nproc", str(n)]
                    out = subprocess.run(cmd, check=True, capture_output=True,
                                         text=True).stdout
                    summary = [json.loads(l) for l in out.splitlines() if '"summary"' in l][-1]
                    times[name].append(summary["mean_step_ms"])
                    comm[name] = summary["comm_bytes_per_step"]
            ta, tl = statistics.median(times["adamw"]), statistics.median(times["lamb"])
            print(f"GPT {a.layers}x{a.width}, N={n}{' ZeRO-3' if n > 1 else ''}: "
                  f"adamw {ta:.2f} ms/step, lamb {tl:.2f} ms/step, ratio {tl / ta:.3f}; "
                  f"sent per rank per step {comm['adamw']} B vs {comm['lamb']} B "
                  f"(+{comm['lamb'] - comm['adamw']} B)")


if __name__ == "__main__":
    main()
