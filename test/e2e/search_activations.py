#!/usr/bin/env python3
"""Activation offload in the memory-budget search (offload-activations=auto).

usage: search_activations.py BIN_DIR SRC_DIR

On the small GPT at 2 ranks (h100 profile):
(a) with a budget the plans without activation offload cannot meet (below
    the smallest peak of recompute none/selective/unit without it, above
    the offloaded floor) the search chooses offload-activations, and the
    chosen plan's device arena fits the budget;
(b) with a roomy budget it does not (the copies cost time and buy nothing);
(c) auto without a budget, and offload-activations=true with a budget
    that only the offloaded schedules meet, behave as the option says;
(d) the chosen plan trains bitwise like the same schedule compiled by
    hand (its strategy's knobs, no budget), 4 steps at 2 ranks.
"""
import json
import os
import subprocess
import sys
import tempfile

from search_common import pinned_knobs, train_losses


def main():
    bindir, src = sys.argv[1], sys.argv[2]
    model = os.path.join(src, "examples", "gpt_small.mlir")
    failures = []

    def report(ok, what):
        print(f"{what}  {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        def compile_(tag, options, check=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer=adamw world-size=2 {options} "
                                f"plan={plan} report=false"],
                               capture_output=True, text=True, check=check)
            return plan if r.returncode == 0 else r.stderr

        def peak(plan):
            return json.load(open(plan))["arena_bytes"]

        # The peaks without activation offload, over the knobs the search
        # turns, and the offloaded floor.
        plain = min(peak(compile_(f"p{rc}{lpu}{rs}",
                                  f"recompute={rc} layers-per-unit={lpu} "
                                  f"reshard-after-forward={rs} prefetch-depth={d}"))
                    for rc in ("none", "selective", "unit") for lpu in (1, 2)
                    for rs in ("true", "false") for d in (0, 1))
        budget = plain - 1
        chosen = compile_("auto-tight", f"memory-budget={budget} offload-activations=auto")
        s = json.load(open(chosen))["strategy"]
        report(s["offload_activations"] is True and peak(chosen) <= budget,
               f"(a) budget {budget} (smallest peak without offload {plain}): chose "
               f"offload-activations, arena {peak(chosen)}")
        roomy = compile_("auto-roomy", "memory-budget=64MiB offload-activations=auto")
        report(json.load(open(roomy))["strategy"]["offload_activations"] is False,
               "(b) budget 64MiB: no activation offload")
        err = compile_("auto-nobudget", "offload-activations=auto", check=False)
        report("auto needs memory-budget" in err, "(c) auto without a budget is refused by name")
        pinned = compile_("pinned", f"memory-budget={budget} offload-activations=true")
        report(json.load(open(pinned))["strategy"]["offload_activations"] is True and
               peak(pinned) <= budget, "(c) offload-activations=true with the budget fits")
        err = compile_("none", f"memory-budget={budget}", check=False)
        report("no schedule fits" in err, "(c) without activation offload nothing fits")

        # (d) the hand-compiled twin of the chosen schedule.
        knobs = pinned_knobs(s) + " offload-activations=true"
        hand = compile_("hand", knobs)
        a, b = train_losses(bindir, chosen), train_losses(bindir, hand)
        report(len(a) == 4 and a == b, f"(d) {knobs}: bitwise equal to the hand-chosen plan")

    if failures:
        print("FAILED:", "; ".join(failures))
        return 1
    print("all activation-offload search checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
