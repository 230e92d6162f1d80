#!/usr/bin/env python3
"""Per-unit prefetch depth in the memory-budget search (docs/BENCHMARKS.md).

fsdp-schedule's unit-prefetch-depth (FSDP2's per-module prefetch) gives
some units' all-gathers their own depth. The memory-budget search uses it
where a prefetching schedule is over the budget: the units whose gathers
are in flight while the live bytes exceed the budget are prefetched one
unit less deep, every other unit keeps the depth.

1. The search with and without it (search-unit-prefetch=true|false),
   predicted by the h100 profile (bf16; not run on a GPU): step, peak,
   strategy, the units made less deep, the compile time, and the speed-up.
2. Measured on this machine's CPU ranks: a GPT (8 layers, width 256) at
   stage 3 on 2 ranks (shared-memory collectives), every knob pinned but
   the per-unit depth (1 layer a unit, no recomputation, resharding,
   BACKWARD_PRE), at a budget one byte under depth 1's arena. Three plans
   alternated ROUNDS times in one run: depth 1 (over the budget, the
   reference), the search's choice (depth 1 with a unit less deep) and
   depth 0 (the uniform schedule that fits): median step time, the ratio
   to depth 0's, the arena measured (planned), the final loss.

  bench/unit_prefetch.py [--bin build/bin] [--cases 7b:8:22GiB,...]
                         [--rounds 3] [--steps 20]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from backward_prefetch import strategy  # noqa: E402
from budget import GEN, MODELS, ROOT, gib, model_file  # noqa: E402

CASES = ("7b:8:21.5GiB,7b:8:22GiB,7b:8:22.5GiB,175b:64:64GiB,175b:64:64GiB:pre,"
         "175b:64:68GiB:pre,175b:64:72GiB:pre")


def searched(a, tmp):
    print("| model | N | budget | pinned | without: step ms, peak GiB, strategy (compile s) | "
          "with: step ms, peak GiB, strategy (compile s) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for case in a.cases.split(","):
        key, n, budget, *pin = case.split(":")
        model = model_file(key, tmp)
        pinned = f"backward-prefetch={pin[0]}" if pin else ""
        cells, steps = [], []
        for flag in ("false", "true"):
            plan = os.path.join(tmp, "s.plan")
            t0 = time.monotonic()
            r = subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} optimizer=adamw "
                                f"param-dtype=bf16 memory-budget={budget} {pinned} "
                                f"search-unit-prefetch={flag} plan={plan} report=false"],
                               capture_output=True, text=True)
            secs = time.monotonic() - t0
            if r.returncode:
                cells.append(f"does not fit ({secs:.1f})")
                steps.append(None)
                continue
            with open(plan) as f:
                s = json.load(f)["strategy"]
            steps.append(s["predicted_step_s"] * 1e3)
            cells.append(f"{steps[-1]:.2f}, {gib(s['peak'])}, {strategy(s)} ({secs:.1f})")
        up = f"x{steps[0] / steps[1]:.3f}" if None not in steps else "-"
        print(f"| {MODELS[key][0]} | {n} | {budget} | {pinned or '-'} | {cells[0]} | "
              f"{cells[1]} | {up} |", flush=True)


def measured(a, tmp):
    model = os.path.join(tmp, "gpt8.mlir")
    subprocess.run([sys.executable, GEN, "gpt", "--vocab", "512", "--ctx", "64", "--layers", "8",
                    "--heads", "4", "--width", "256", "--batch", "4", "-o", model], check=True)
    pin = ("world-size=2 optimizer=adamw stage=3 layers-per-unit=1 recompute=none "
           "reshard-after-forward=true backward-prefetch=pre report=false")

    def compile_(tag, opts):
        plan = os.path.join(tmp, tag + ".plan")
        subprocess.run([os.path.join(a.bin, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline={pin} {opts} plan={plan}"], check=True)
        with open(plan) as f:
            return plan, json.load(f)

    plans = {"depth 1": compile_("d1", "prefetch-depth=1")}
    budget = plans["depth 1"][1]["arena_bytes"] - 1
    plans["searched"] = compile_("s", f"prefetch-depth=1 memory-budget={budget}")
    plans["depth 0"] = compile_("d0", "prefetch-depth=0")
    st = plans["searched"][1]["strategy"]
    print(f"\nbudget {budget} bytes (depth 1's arena - 1): the search chose "
          f"unit-prefetch-depth={st['unit_prefetch_depth']}\n")
    times = {m: [] for m in plans}
    result = {}
    for _ in range(a.rounds):
        for m, (plan, _) in plans.items():
            out = subprocess.run([os.path.join(a.bin, "fsdp-run"), plan, "--json", "--nproc",
                                  "2", "--threads", "1", "--steps", str(a.steps)],
                                 capture_output=True, text=True, check=True).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            steps = [r for r in rows if "step" in r and "ms" in r]
            times[m].append(statistics.median(r["ms"] for r in steps[2:]))  # warm
            s = [r for r in rows if r.get("summary")][0]
            result[m] = (s["measured_high_water"], s["predicted_peak"], steps[-1]["loss"])
    print("| plan | median step ms per round | vs depth 0 (median) | arena measured (planned) "
          "| final loss |")
    print("|---|---|---|---|---|")
    ref = statistics.median(times["depth 0"])
    for m in plans:
        med = statistics.median(times[m])
        print(f"| {m} | {', '.join(f'{t:.2f}' for t in times[m])} | x{med / ref:.3f} | "
              f"{result[m][0]} ({result[m][1]}) | {result[m][2]:.6f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--cases", default=CASES,
                    help="MODEL:N:BUDGET[:pre|post] entries (models: " + ",".join(MODELS) + ")")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-measured", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        searched(a, tmp)
        if not a.skip_measured:
            measured(a, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
