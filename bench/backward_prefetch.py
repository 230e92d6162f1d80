#!/usr/bin/env python3
"""backward-prefetch pre | post | none side by side (docs/BENCHMARKS.md).

FSDP's BackwardPrefetch: pre (BACKWARD_PRE, the default) issues unit k-1's
all-gather as soon as unit k's has arrived, so it travels while unit k
computes its gradients (both units gathered at once); post (BACKWARD_POST)
issues it right after unit k's last read of its parameters (one unit
gathered in the backward, less overlap); none where it is read.

1. Predicted (h100 profile, fsdp-opt simulate=true; not run on a GPU): for
   each GPT shape and world size at stage 3, every other knob at its
   default, the step (exposed communication) and planned peak per rank.
2. The memory-budget search on the 175B shape (h100, bf16) under each
   budget, backward-prefetch pinned to pre (the search as it was) and
   free (post weighed at depth 1): predicted step, peak, strategy.
3. Measured on this machine's CPU ranks: a GPT (8 layers, width 256) at
   stage 3 on 2 ranks (shared-memory collectives), the three modes
   alternated ROUNDS times in one run: median step time, its ratio to
   pre's, and the arena fsdp-run measured (== planned).

  bench/backward_prefetch.py [--bin build/bin] [--models gpt2,7b,175b]
                             [--ranks 8,64,1024] [--search-ranks 64,1024]
                             [--budgets 80GiB,72GiB,68GiB,64GiB] [--rounds 3] [--steps 20]
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
from budget import GEN, MODELS, ROOT, gib, model_file, simulate  # noqa: E402

MODES = ("pre", "post", "none")


def predicted(a, tmp):
    print("| model | N | " + " | ".join(f"{m}: step ms (exposed %), peak GiB" for m in MODES)
          + " | post vs pre: step, peak |")
    print("|---|---|" + "---|" * (len(MODES) + 1))
    for key in a.models.split(","):
        label = MODELS[key][0]
        model = model_file(key, tmp)
        for n in [int(x) for x in a.ranks.split(",")]:
            cells, got = [], {}
            for m in MODES:
                step, exp, peak = simulate(a.bin, model, f"world-size={n} optimizer=adamw stage=3 "
                                           f"param-dtype=bf16 backward-prefetch={m}")
                got[m] = (step, peak)
                cells.append(f"{step:.1f} ({exp:.1f}), {gib(peak)}")
            ratio = got["post"][0] / got["pre"][0]
            saved = (got["pre"][1] - got["post"][1]) / 2**30
            print(f"| {label} | {n} | " + " | ".join(cells) +
                  f" | x{ratio:.3f}, -{saved:.2f} GiB |", flush=True)


def strategy(s):
    """A plan's `strategy` in a few words."""
    what = [f"{s['layers_per_unit']} layer(s) a unit", f"recompute {s['recompute']}"
            + (f" (first {s['recompute_units']})" if s["recompute_units"] >= 0 else ""),
            f"reshard {s['reshard_group'] or str(s['reshard_after_forward']).lower()}"
            + (f" (first {s['reshard_units']})" if s["reshard_units"] >= 0 else ""),
            f"depth {s['prefetch_depth']}"]
    if s["prefetch_depth"] and s["backward_prefetch"] != "pre":
        what.append(s["backward_prefetch"])
    if s.get("unit_prefetch_depth"):
        # Entries UNIT=D or UNIT=F/B (forward / backward), by value.
        values = [e.rsplit("=", 1)[1] for e in s["unit_prefetch_depth"].split(",")]
        for v in sorted(set(values)):
            what.append(f"{values.count(v)} unit(s) at depth {v}"
                        + (" (forward/backward)" if "/" in v else ""))
    return ", ".join(what)


def searched(a, tmp):
    """The memory-budget search on the 175B shape, backward-prefetch pinned
    to pre (the search before it weighed post) and free."""
    label = MODELS["175b"][0]
    model = model_file("175b", tmp)
    print(f"\n{label}, memory-budget search (h100, bf16):\n")
    print("| N | budget | pre pinned: step ms, peak GiB, strategy | searched: step ms, peak GiB, "
          "strategy | speed-up |")
    print("|---|---|---|---|---|")

    for n in [int(x) for x in a.search_ranks.split(",")]:
        for budget in a.budgets.split(","):
            cells, steps = [], []
            for pin in ("backward-prefetch=pre", ""):
                plan = os.path.join(tmp, "s.plan")
                r = subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                                    f"--fsdp-pipeline=world-size={n} optimizer=adamw "
                                    f"param-dtype=bf16 memory-budget={budget} {pin} "
                                    f"plan={plan} report=false"], capture_output=True, text=True)
                if r.returncode:
                    cells.append("does not fit")
                    steps.append(None)
                    continue
                with open(plan) as f:
                    s = json.load(f)["strategy"]
                steps.append(s["predicted_step_s"] * 1e3)
                cells.append(f"{steps[-1]:.0f}, {gib(s['peak'])}, {strategy(s)}")
            up = f"x{steps[0] / steps[1]:.3f}" if None not in steps else "-"
            print(f"| {n} | {budget} | {cells[0]} | {cells[1]} | {up} |", flush=True)


def measured(a, tmp):
    model = os.path.join(tmp, "gpt8.mlir")
    subprocess.run([sys.executable, GEN, "gpt", "--vocab", "512", "--ctx", "64", "--layers", "8",
                    "--heads", "4", "--width", "256", "--batch", "4", "-o", model], check=True)
    plans = {}
    for m in MODES:
        plans[m] = os.path.join(tmp, f"gpt8-{m}.plan")
        subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline=world-size=2 optimizer=adamw stage=3 "
                        f"backward-prefetch={m} plan={plans[m]} report=false"], check=True)
    times = {m: [] for m in MODES}
    arena = {}
    for _ in range(a.rounds):
        for m in MODES:
            out = subprocess.run([os.path.join(a.bin, "fsdp-run"), plans[m], "--json", "--nproc",
                                  "2", "--threads", "1", "--steps", str(a.steps)],
                                 capture_output=True, text=True, check=True).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            steps = [r["ms"] for r in rows if "step" in r and "ms" in r][2:]  # warm
            times[m].append(statistics.median(steps))
            s = [r for r in rows if r.get("summary")][0]
            arena[m] = (s["measured_high_water"], s["predicted_peak"])
    print("\n| mode | median step ms per round | vs pre (median) | arena measured (planned) |")
    print("|---|---|---|---|")
    pre = statistics.median(times["pre"])
    for m in MODES:
        med = statistics.median(times[m])
        print(f"| {m} | {', '.join(f'{t:.2f}' for t in times[m])} | x{med / pre:.3f} | "
              f"{arena[m][0]} ({arena[m][1]}) |")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--models", default="gpt2,7b,175b")
    ap.add_argument("--ranks", default="8,64,1024")
    ap.add_argument("--search-ranks", default="64,1024")
    ap.add_argument("--budgets", default="80GiB,72GiB,68GiB,64GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        predicted(a, tmp)
        searched(a, tmp)
        measured(a, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
