#!/usr/bin/env python3
"""Activation offload's copies on their own stream: what it buys, predicted.

fsdp-offload-activations' async copies between the arenas used to share
the communication stream with the collectives (one queue: a prefetching
all-gather waited behind an activation's copy, and a copy behind a
reduce-scatter). They now run on the device's copy stream (CUDA: a
stream of their own, the copy engines; the CPU device copies in place).

For GPT-2 124M (examples/gpt2.mlir, B=4, T=1024, f32, stage 3) at 8, 16
and 64 ranks (8 per node, InfiniBand between nodes) with each
recomputation, with and without activation offload, this compiles the
plan once and predicts its step on the h100 profile twice, in one run:
with the copies on the communication stream (fsdp-sim as of commit
be54cf4, the last before the copy stream, read from git) and on the copy
stream (this tree's fsdp-sim, which fsdp-opt simulate=true matches). It
prints both, their ratio, and where the copies' time went. Not measured
on a GPU: a prediction of the model in passes/CostModel.cpp.

  bench/copy_stream.py [BIN_DIR] [--ranks 8,16,64]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BEFORE = "be54cf4"  # the last commit with the copies on the comm stream


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir", nargs="?", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--ranks", default="8,16,64")
    a = ap.parse_args()
    b = lambda t: os.path.join(a.bindir, t)
    with tempfile.TemporaryDirectory() as tmp:
        old_sim = os.path.join(tmp, "fsdp-sim-before")
        r = subprocess.run(["git", "-C", ROOT, "show", f"{BEFORE}:tools/fsdp-sim/fsdp-sim"],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"copy_stream.py: cannot read fsdp-sim at {BEFORE} from git "
                     f"(a clone with history is needed): {r.stderr.strip()}")
        with open(old_sim, "w") as f:
            f.write(r.stdout)

        def sim(tool, plan):
            out = subprocess.run([sys.executable, tool, plan, "--profile", "h100", "--json"],
                                 check=True, capture_output=True, text=True).stdout
            d = json.loads(out)
            return d[0] if isinstance(d, list) else d

        print("| ranks | recompute | offload | device arena | comm stream (before) | "
              "copy stream | ratio | copies / compute waited | exposed comm |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n in (int(x) for x in a.ranks.split(",")):
            for rec in ("none", "selective", "unit"):
                for off in ("false", "true"):
                    plan = os.path.join(tmp, f"g{n}-{rec}-{off}.plan")
                    subprocess.run(
                        [b("fsdp-opt"), os.path.join(ROOT, "examples", "gpt2.mlir"), "-o",
                         os.devnull,
                         f"--fsdp-pipeline=optimizer=adamw world-size={n} stage=3 "
                         f"recompute={rec} offload-activations={off} plan={plan} report=false"],
                        check=True, capture_output=True, text=True)
                    arena = json.load(open(plan))["arena_bytes"] / 2**30
                    before, after = sim(old_sim, plan), sim(b("fsdp-sim"), plan)
                    print(f"| {n} | {rec} | {off} | {arena:.2f} GiB | "
                          f"{before['step_ms']:.1f} ms | {after['step_ms']:.1f} ms | "
                          f"{before['step_ms'] / after['step_ms']:.2f}x | "
                          f"{after['copy_ms']:.1f} / {after['copy_exposed_ms']:.2f} ms | "
                          f"{before['exposed_comm_ms']:.2f} -> {after['exposed_comm_ms']:.2f} ms |")


if __name__ == "__main__":
    main()
