#!/usr/bin/env python3
"""Two-level host collectives (`--comm hybrid`: shared memory within a
node, Gloo between nodes) against Gloo over every rank (what a multi-node
job of CPU ranks ran before) and shared memory over every rank (one
machine, the floor), same plans, one run.

N ranks of this machine are laid out as 2 nodes of N / 2 (`fsdp-run
--nnodes 2`, as a multi-node launcher numbers them), so "between nodes" is
TCP loopback here, not a network: the figures show what the two levels
save in messages and copies, not a NIC's bandwidth. Models: the MLP and
small GPT of bench/simulator.py, stage 3 (1-D mesh) and HSDP (mesh 2 x N/2:
shard groups are the nodes), AdamW, 1 thread per rank; runs alternate
between the three communicators, each figure the median over ROUNDS runs
of the median of steps 3..STEPS; the losses of hybrid and Gloo are
compared (equal up to the summation order).

  bench/hybrid_comm.py BIN_DIR [--ranks 4] [--steps 30] [--rounds 3]
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

COMMS = {"gloo": ["--comm", "gloo"], "hybrid": ["--nnodes", "2"], "shm": ["--comm", "shm"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--ranks", default="4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    b = lambda t: os.path.join(a.bindir, t)
    ranks = [int(x) for x in a.ranks.split(",")]
    print(f"{'model':>5} {'N':>2} {'mesh':>6} {'gloo ms':>9} {'hybrid ms':>10} {'shm ms':>9} "
          f"{'hybrid/gloo':>12} {'max loss rel diff':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in MODELS.items():
            model = os.path.join(tmp, name + ".mlir")
            subprocess.run([sys.executable, GEN] + args + ["-o", model], check=True)
            for n in ranks:
                for mesh in ("", f"mesh=2x{n // 2}"):
                    plan = os.path.join(tmp, f"{name}{n}{mesh}.plan")
                    subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                                    f"--fsdp-pipeline=optimizer=adamw stage=3 world-size={n} "
                                    f"{mesh} plan={plan} report=false"], check=True)
                    ms = {c: [] for c in COMMS}
                    losses, header = {}, {}
                    for _ in range(a.rounds):
                        for c, extra in COMMS.items():
                            out = subprocess.run(
                                [b("fsdp-run"), plan, "--nproc", str(n), "--threads", "1",
                                 "--steps", str(a.steps), "--json"] + extra,
                                check=True, capture_output=True, text=True).stdout
                            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
                            header[c] = rows[-1]["comm"]
                            rows = [r for r in rows if "step" in r and not r.get("summary")
                                    and not r.get("eval")]
                            ms[c].append(statistics.median(r["ms"] for r in rows[2:]))
                            losses[c] = [r["loss"] for r in rows]
                    assert header["hybrid"].startswith("shm+gloo (2 nodes"), header
                    g, h, s = (statistics.median(ms[c]) for c in COMMS)
                    diff = max(abs(x - y) / abs(x)
                               for x, y in zip(losses["gloo"], losses["hybrid"]))
                    print(f"{name:>5} {n:>2} {mesh[5:] or '1-D':>6} {g:>9.2f} {h:>10.2f} "
                          f"{s:>9.2f} {g / h:>11.2f}x {diff:>18.2e}")


if __name__ == "__main__":
    main()
