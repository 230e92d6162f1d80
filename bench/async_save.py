#!/usr/bin/env python3
"""Checkpoints in the background (fsdp-run --async-save, docs/BENCHMARKS.md):
how long a save holds training, synchronous against asynchronous.

Measured on this machine's CPU ranks: an MLP (AdamW, ZeRO-3 and stage 0 on
2 ranks: each rank writes its shard, or the whole state) trained STEPS steps
with a checkpoint every EVERY steps, with no checkpoints, synchronous
checkpoints and --async-save, alternated ROUNDS times in one run. Printed:
the checkpoint bytes a rank writes, the median time one save holds the
training thread (the JSON's save_ms; asynchronous: the directory's barrier
and the snapshot in host memory, plus any wait for the save before; the
first asynchronous save apart: it allocates the staging copy), the
median step time of the steps that ran while a file was written (against
the run without checkpoints: what the writer thread costs the compute),
the wait for the last save at the end, and the whole run's wall time.

  bench/async_save.py [--bin build/bin] [--hidden 2048] [--rounds 3]
                      [--steps 30] [--every 10] [--dir /tmp]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from budget import GEN, ROOT  # noqa: E402


def run(bindir, plan, steps, extra):
    t = time.perf_counter()
    out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json", "--nproc", "2",
                          "--threads", "1", "--steps", str(steps)] + extra,
                         capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps_ = [r for r in rows if "step" in r]
    return wall, steps_, [r for r in rows if r.get("summary")][0]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="where the checkpoints go (the disk measured)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="async-save-", dir=a.dir)
    try:
        mlir = os.path.join(work, "m.mlir")
        subprocess.run([sys.executable, GEN, "mlp", "--hidden", str(a.hidden), "--blocks",
                        str(a.blocks), "--batch", "16", "-o", mlir], check=True)
        print(f"MLP hidden {a.hidden}, {a.blocks} blocks, AdamW, 2 CPU ranks, {a.steps} steps, "
              f"a checkpoint every {a.every} steps into {a.dir}, {a.rounds} rounds alternated\n")
        print("| stage | bytes a rank writes | save holds training (ms): sync | async, first | async, later | ratio (later) "
              "| of it waiting for the save before (ms) | step while writing (ms): none | async | ratio "
              "| end wait async (ms) "
              "| run wall s: none | sync | async |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for stage in (3, 0):
            plan = os.path.join(work, f"s{stage}.plan")
            subprocess.run([os.path.join(a.bin, "fsdp-opt"), mlir, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw world-size=2 stage={stage} "
                            f"plan={plan} report=false"], check=True)
            hold = {"sync": [], "async": []}
            first = []
            waits = []
            during = {"none": [], "async": []}
            walls = {"none": [], "sync": [], "async": []}
            finish, written = [], 0
            for _ in range(a.rounds):
                for mode in ("none", "sync", "async"):
                    ck = os.path.join(work, f"ck-{stage}-{mode}")
                    shutil.rmtree(ck, ignore_errors=True)
                    extra = [] if mode == "none" else ["--ckpt-dir", ck, "--save-every",
                                                       str(a.every)]
                    extra += ["--async-save"] if mode == "async" else []
                    wall, steps, summary = run(a.bin, plan, a.steps, extra)
                    walls[mode].append(wall)
                    if mode != "none":
                        held = [r["save_ms"] for r in steps if "save_ms" in r]
                        if mode == "async":  # the first allocates the staging copy
                            first.append(held[0])
                            held = held[1:]
                        hold[mode] += held
                        waits += [r["save_wait_ms"] for r in steps if "save_wait_ms" in r]
                    # The steps right after a save (its file is being written
                    # in the async run), and the same steps of the run without.
                    after = [r["ms"] for r in steps
                             if r["step"] > 2 and (r["step"] - 1) % a.every == 0]
                    if mode in during:
                        during[mode] += after
                    if mode == "async":
                        finish.append(summary["save_finish_ms"])
                    if mode == "sync":
                        last = sorted(os.listdir(ck))[-1]
                        written = os.path.getsize(os.path.join(
                            ck, last, "rank-00000-of-00002.safetensors"))
                    shutil.rmtree(ck, ignore_errors=True)
            med = statistics.median
            hs, ha = med(hold["sync"]), med(hold["async"])
            dn, da = med(during["none"]), med(during["async"])
            print(f"| {stage} | {written / 2**20:.1f} MiB | {hs:.1f} | {med(first):.1f} | {ha:.1f} "
                  f"| x{ha / hs:.3f} "
                  f"| {med(waits):.1f} | {dn:.1f} | {da:.1f} | x{da / dn:.3f} | {med(finish):.1f} "
                  f"| {med(walls['none']):.2f} | {med(walls['sync']):.2f} "
                  f"| {med(walls['async']):.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
