#!/usr/bin/env python3
"""The memory-budget search on GPT shapes: planned peak, predicted step,
exposed communication, chosen strategy and compile time (docs/BENCHMARKS.md).

  bench/budget.py [--bin build/bin] [--ranks 8,64,512,1024] [--budget 80GiB]
                  [--models gpt2,1.3b,7b,175b] [--extra "param-dtype=bf16"]

Each model is written with examples/gen_models.py (GPT-2 124M is
examples/gpt2.mlir, batch 4 x 1024 per rank; the others batch 1 per rank)
and compiled with
  fsdp-opt M --fsdp-pipeline="world-size=N memory-budget=B EXTRA plan=P"
(h100 profile, 8 ranks per node); compile time is the wall time of that
command.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GEN = os.path.join(ROOT, "examples", "gen_models.py")

MODELS = {
    "gpt2": ("GPT-2 124M", None),
    "1.3b": ("GPT-3 1.3B-shaped", ["--vocab", "50257", "--ctx", "2048", "--layers", "24",
                                   "--heads", "16", "--width", "2048", "--batch", "1"]),
    "7b": ("7B-shaped (Llama-2-7B size)", ["--vocab", "50257", "--ctx", "4096", "--layers",
                                            "32", "--heads", "32", "--width", "4096",
                                            "--batch", "1"]),
    "175b": ("GPT-3 175B-shaped", ["--vocab", "50257", "--ctx", "2048", "--layers", "96",
                                   "--heads", "96", "--width", "12288", "--batch", "1"]),
}


def gib(b):
    return f"{b / 2**30:.2f}"


def model_file(key, tmp):
    """MODELS[key]'s model text: examples/gpt2.mlir, or written to tmp."""
    args = MODELS[key][1]
    if not args:
        return os.path.join(ROOT, "examples", "gpt2.mlir")
    path = os.path.join(tmp, key + ".mlir")
    if not os.path.exists(path):
        subprocess.run([sys.executable, GEN, "gpt"] + args + ["-o", path], check=True)
    return path


def simulate(bindir, model, pipeline):
    """fsdp-opt MODEL --fsdp-pipeline="PIPELINE simulate=true": the predicted
    step (ms), exposed communication (%) and planned peak per rank (bytes)."""
    r = subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline={pipeline} simulate=true"],
                       capture_output=True, text=True, check=True)
    step = float(re.search(r"\n  step\s+([0-9.]+) ms", r.stderr).group(1))
    exp = float(re.search(r"exposed communication\s+[0-9.]+ ms\s+([0-9.]+)%", r.stderr).group(1))
    peak = int(re.search(r"peak per rank\s+([0-9]+)", r.stderr).group(1))
    return step, exp, peak


def alternated(bindir, plans, rounds, steps, nproc=2):
    """Runs every plan of {name: path} on nproc CPU ranks (one thread a
    rank) `rounds` times, alternating them, each for `steps` steps: {name:
    the median step (ms, after the first two) of each round}, and {name:
    fsdp-run's summary row of its last run}."""
    times = {k: [] for k in plans}
    summary = {}
    for _ in range(rounds):
        for k, plan in plans.items():
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json", "--nproc",
                                  str(nproc), "--threads", "1", "--steps", str(steps)],
                                 capture_output=True, text=True, check=True).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            times[k].append(statistics.median([r["ms"] for r in rows
                                               if "step" in r and "ms" in r][2:]))
            summary[k] = [r for r in rows if r.get("summary")][0]
    return times, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--ranks", default="8,64,512,1024")
    ap.add_argument("--budget", default="80GiB")
    ap.add_argument("--models", default="gpt2,1.3b,7b,175b")
    ap.add_argument("--extra", default="param-dtype=bf16")
    a = ap.parse_args()
    print(f"| model | N | planned peak GiB | predicted step ms | exposed comm % | "
          f"strategy (layers-per-unit, recompute, reshard-after-forward, prefetch-depth) "
          f"| compile s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for key in a.models.split(","):
            label, args = MODELS[key]
            model = os.path.join(ROOT, "examples", "gpt2.mlir")
            if args:
                model = os.path.join(tmp, key + ".mlir")
                subprocess.run([sys.executable, GEN, "gpt"] + args + ["-o", model],
                               check=True)
            for n in [int(x) for x in a.ranks.split(",")]:
                plan = os.path.join(tmp, "p.plan")
                t0 = time.time()
                r = subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                                    f"--fsdp-pipeline=world-size={n} memory-budget={a.budget} "
                                    f"{a.extra} plan={plan} report=false"],
                                   capture_output=True, text=True)
                dt = time.time() - t0
                if r.returncode:
                    msg = r.stderr.strip().splitlines()[0].split("error: ")[-1]
                    print(f"| {label} | {n} | - | - | - | does not fit: {msg[:160]} | {dt:.2f} |")
                    continue
                with open(plan) as f:
                    p = json.load(f)
                s = p["strategy"]
                rc = s["recompute"]
                if s.get("recompute_units", -1) >= 0:
                    rc += f" (first {s['recompute_units']} units)"
                reshard = ("false" if not s["reshard_after_forward"]
                           else str(s["reshard_group"]) if s.get("reshard_group")
                           else "true")
                if s["reshard_after_forward"] and s.get("reshard_units", -1) >= 0:
                    reshard += f" (first {s['reshard_units']} units)"
                strat = f"{s['layers_per_unit']}, {rc}, {reshard}, {s['prefetch_depth']}"
                print(f"| {label} | {n} | {gib(p['memory']['peak'])} | "
                      f"{s['predicted_step_s'] * 1e3:.1f} | {s['exposed_comm_pct']:.1f} | "
                      f"{strat} | {dt:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
