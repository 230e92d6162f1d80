#!/usr/bin/env python3
"""Hierarchical qgZ's node exchange behind the backward: fsdp-schedule's
overlap-node-exchange (session 49) and node-comm-stream (session 50);
docs/BENCHMARKS.md.

With gradient-quantization=int8 on a shard group of whole nodes
(ranks-per-node=L), each unit's gradients go through a node all-to-all,
the node average, a requantization and a cross-node all-to-all. Three
schedules of the same arithmetic:
- "node stream" (the default): the node all-to-all is waited for only
  where the next unit's node all-to-all is issued (it travels behind that
  unit's backward), and node all-to-alls run on a second comm stream, so
  one never queues behind the previous unit's cross-node all-to-all;
- "one stream" (node-comm-stream=false, session 49): the same order, every
  collective on one comm stream;
- "waited" (overlap-node-exchange=false node-comm-stream=false, session
  48): each node all-to-all waited for at once.

1. Predicted (h100 profile: nodes of 8; fsdp-opt simulate=true, not run on
   a GPU or across nodes): GPT shapes at ZeRO-3, bf16: step (exposed
   communication), planned peak.
2. Measured on this machine's CPU ranks: the MLP of examples/ (hidden 256,
   8 blocks) at ZeRO-3 on 4 ranks, 2 "nodes" of 2 (--nnodes 2 --comm
   hybrid: shared memory within a node, Gloo across), the three schedules
   alternated ROUNDS times in one run, each with --trace: median step, and
   the compute thread's time in the waits for node and cross-node
   exchanges (a step, a rank, from the trace). On a shared box the ranks
   share cores, so the step time is noisy; the wait time is the direct
   measure of what the schedule hides.

   Also ZeRO++'s three parts together (hpZ + qwZ + qgZ), predicted, with
   and without the node comm stream.

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


CONFIGS = {"node stream": "", "one stream": "node-comm-stream=false",
           "waited": "overlap-node-exchange=false node-comm-stream=false"}


def predicted(a, tmp):
    print("| model | N | " + " | ".join(f"{k}: step ms (exposed %), peak GiB" for k in CONFIGS) +
          " | node stream / one stream | node stream / waited |")
    print("|---|---|" + "---|" * (len(CONFIGS) + 2))
    for key, n in SHAPES:
        model = model_file(key, tmp)
        cells, steps = [], []
        for opts in CONFIGS.values():
            step, exp, peak = simulate(a.bin, model, f"optimizer=adamw world-size={n} stage=3 "
                                       f"param-dtype=bf16 {QGZ} {opts} report=false")
            cells.append(f"{step:.2f} ({exp:.1f}%), {gib(peak)}")
            steps.append(step)
        print(f"| {MODELS[key][0]} | {n} | {' | '.join(cells)} | "
              f"{steps[0] / steps[1]:.3f} | {steps[0] / steps[2]:.3f} |")


ZEROPP = [("ZeRO-3", ""), ("qgZ", QGZ), ("qwZ + qgZ", f"weight-quantization=int8 {QGZ}"),
          ("hpZ + qwZ + qgZ", f"reshard-after-forward=8 weight-quantization=int8 {QGZ}")]


def zeropp(a, tmp):
    """ZeRO++'s three together (hpZ: the backward gathers within the node
    of 8; qwZ: int8 weight gathers; qgZ: hierarchical), with the node
    comm stream and without (predicted, h100)."""
    print("| model | N | ZeRO++ parts | node stream: step ms (exposed %), peak GiB | "
          "one stream | ratio |")
    print("|---|---|---|---|---|---|")
    for key, n in SHAPES[1:]:
        model = model_file(key, tmp)
        for name, opts in ZEROPP:
            cells, steps = [], []
            for ns in ("true", "false"):
                step, exp, peak = simulate(a.bin, model, f"optimizer=adamw world-size={n} "
                                           f"stage=3 param-dtype=bf16 {opts} "
                                           f"node-comm-stream={ns} report=false")
                cells.append(f"{step:.2f} ({exp:.1f}%), {gib(peak)}")
                steps.append(step)
            print(f"| {MODELS[key][0]} | {n} | {name} | {cells[0]} | {cells[1]} | "
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
    for k, opts in CONFIGS.items():
        plans[k] = os.path.join(tmp, k.replace(" ", "-") + ".plan")
        subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline=optimizer=adamw world-size=4 stage=3 {QGZ} "
                        f"ranks-per-node=2 {opts} report=false plan={plans[k]}"], check=True)
    steps = {k: [] for k in plans}
    waits = {k: {"node": [], "cross": []} for k in plans}
    loss = {}
    for _ in range(a.rounds):
        for k, path in plans.items():
            trace = os.path.join(tmp, "overlap.trace")
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
    print("| schedule | step ms (median of rounds) | waiting for node "
          "exchanges, ms a step a rank | waiting for cross-node exchanges | total wait |")
    print("|---|---|---|---|---|")
    for k in plans:
        n, c = (statistics.median(waits[k][g]) for g in ("node", "cross"))
        print(f"| {k} | {med[k]:.2f} ({', '.join(f'{t:.1f}' for t in steps[k])}) | "
              f"{n:.3f} | {c:.3f} | {n + c:.3f} |")
    same = len(set(loss.values())) == 1
    print(f"step ratio node stream / one stream {med['node stream'] / med['one stream']:.3f}, "
          f"/ waited {med['node stream'] / med['waited']:.3f}; final loss "
          f"{', '.join(str(v) for v in loss.values())} "
          f"({'bitwise equal' if same else 'DIFFERENT'})")


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
            zeropp(a, tmp)
            print()
        measured(a, tmp)


if __name__ == "__main__":
    main()
