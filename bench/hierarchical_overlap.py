#!/usr/bin/env python3
"""Hierarchical qgZ's node exchange behind the next unit's backward
(fsdp-schedule overlap-node-exchange, session 49; docs/BENCHMARKS.md).

With gradient-quantization=int8 on a shard group of whole nodes
(ranks-per-node=L), each unit's gradients go through a node all-to-all,
the node average, a requantization and a cross-node all-to-all.
overlap-node-exchange=true (the default) waits for the node all-to-all
only where the next unit's node all-to-all is issued, so it travels behind
that unit's backward; false waits for it at once.

1. Predicted (h100 profile: nodes of 8; fsdp-opt simulate=true, not run on
   a GPU or across nodes): GPT shapes at ZeRO-3, bf16, true and false: step
   (exposed communication), planned peak.
2. Measured on this machine's CPU ranks: the MLP of examples/ (hidden 256,
   8 blocks) at ZeRO-3 on 4 ranks, 2 "nodes" of 2 (--nnodes 2 --comm
   hybrid: shared memory within a node, Gloo across), true and false
   alternated ROUNDS times in one run, each with --trace: median step, and
   the compute thread's time in the waits for node and cross-node
   exchanges (a step, a rank, from the trace). On a shared box the ranks
   share cores, so the step time is noisy; the wait time is the direct
   measure of what the schedule hides.

  bench/hierarchical_overlap.py [--bin build/bin] [--rounds 5] [--steps 20]
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
from budget import MODELS, ROOT, gib, model_file, simulate  # noqa: E402

SHAPES = [("gpt2", 32), ("gpt2", 64), ("1.3b", 64)]
QGZ = "gradient-quantization=int8"


def predicted(a, tmp):
    print("| model | N | overlap-node-exchange=true: step ms (exposed %), peak GiB | "
          "false: step ms (exposed %), peak GiB | step ratio |")
    print("|---|---|---|---|---|")
    for key, n in SHAPES:
        model = model_file(key, tmp)
        cells, steps = [], []
        for on in ("true", "false"):
            step, exp, peak = simulate(a.bin, model, f"optimizer=adamw world-size={n} stage=3 "
                                       f"param-dtype=bf16 {QGZ} overlap-node-exchange={on} "
                                       "report=false")
            cells.append(f"{step:.2f} ({exp:.1f}%), {gib(peak)}")
            steps.append(step)
        print(f"| {MODELS[key][0]} | {n} | {cells[0]} | {cells[1]} | "
              f"{steps[0] / steps[1]:.3f} |")


def exchange_waits(plan, trace):
    """ms a step a rank the compute thread spends in the waits of the node
    and the cross-node all-to-alls (steps after the first)."""
    prog = plan["program"]
    group = {}
    for k, inst in enumerate(prog):
        if inst["op"] == "all_to_all":
            w = next(j for j in range(k + 1, len(prog))
                     if prog[j]["op"] == "wait" and prog[j]["in"] == inst["out"])
            group[w] = inst["attrs"].get("group", "world")
    ev = trace["traceEvents"] if isinstance(trace, dict) else trace
    ev = [e for e in ev if e.get("ph") == "X" and e.get("tid") == 0]
    first = min(e["args"]["step"] for e in ev)
    use = [e for e in ev if e["args"]["step"] != first]
    n = len({(e["pid"], e["args"]["step"]) for e in use})
    out = {"node": 0.0, "cross": 0.0}
    for e in use:
        g = group.get(e["args"]["instruction"])
        if g in out:
            out[g] += e["dur"] / 1000 / n
    return out


def measured(a, tmp):
    model = os.path.join(ROOT, "examples", "mlp.mlir")
    plans = {}
    for on in ("true", "false"):
        plans[on] = os.path.join(tmp, f"overlap-{on}.plan")
        subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline=optimizer=adamw world-size=4 stage=3 {QGZ} "
                        f"ranks-per-node=2 overlap-node-exchange={on} report=false "
                        f"plan={plans[on]}"], check=True)
    steps = {k: [] for k in plans}
    waits = {k: {"node": [], "cross": []} for k in plans}
    loss = {}
    for _ in range(a.rounds):
        for k, path in plans.items():
            trace = os.path.join(tmp, f"overlap-{k}.trace")
            out = subprocess.run([os.path.join(a.bin, "fsdp-run"), path, "--json", "--nproc",
                                  "4", "--nnodes", "2", "--comm", "hybrid", "--threads", "1",
                                  "--steps", str(a.steps), "--trace", trace],
                                 capture_output=True, text=True, check=True).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            steps[k].append(statistics.median([r["ms"] for r in rows
                                               if "step" in r and "ms" in r][2:]))
            loss[k] = [r for r in rows if r.get("summary")][0].get("final_loss")
            w = exchange_waits(json.load(open(path)), json.load(open(trace)))
            for g in w:
                waits[k][g].append(w[g])
    med = {k: statistics.median(v) for k, v in steps.items()}
    print("| overlap-node-exchange | step ms (median of rounds) | waiting for node "
          "exchanges, ms a step a rank | waiting for cross-node exchanges |")
    print("|---|---|---|---|")
    for k in plans:
        print(f"| {k} | {med[k]:.2f} ({', '.join(f'{t:.1f}' for t in steps[k])}) | "
              f"{statistics.median(waits[k]['node']):.3f} | "
              f"{statistics.median(waits[k]['cross']):.3f} |")
    nt, nf = (statistics.median(waits[k]["node"]) for k in ("true", "false"))
    print(f"step ratio true/false {med['true'] / med['false']:.3f}; node-exchange wait "
          f"ratio {nt / nf:.3f}; final loss {loss['true']} vs {loss['false']} "
          f"({'bitwise equal' if loss['true'] == loss['false'] else 'DIFFERENT'})")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-predicted", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not a.skip_predicted:
            predicted(a, tmp)
            print()
        measured(a, tmp)


if __name__ == "__main__":
    main()
