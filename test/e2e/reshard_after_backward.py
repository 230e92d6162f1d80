#!/usr/bin/env python3
"""Gathers kept across micro-batches (reshard-after-backward=false, FSDP2's
set_reshard_after_backward(False)): with gradient accumulation each
micro-batch's forward reads the unit's last gather of the micro-batch
before instead of gathering it again.

usage: reshard_after_backward.py BIN_DIR SRC_DIR

A GPT of 4 layers at stage 3 with K micro-batches. For every configuration
below, reshard-after-backward=false against true (the default):
(a) the losses of 4 steps and the final parameters (--save) are bitwise
    equal (a unit's storage is written only by the optimizer, after the
    last micro-batch, so every gather of it in a step is the same bytes);
(b) fsdp-run measures the arenas (offloaded: both) equal to the plan;
(c) the plan has (K - 1) x U all-gathers fewer, U the units (each read in
    the forward) (with reshard-after-forward=false: U in all,
    one a unit a step), and fsdp-run moves fewer bytes a step.
Then the memory-budget search on the h100 profile (2 ranks, 2 micro-batches):
(d) reshard-after-backward=false is predicted faster (fsdp-opt
    simulate=true and fsdp-sim agree), and with a loose budget the search
    chooses it, the plan equal to the same knobs compiled by hand; without
    accumulation it has no choice to make (strategy: true).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

from e2e_lib import Checks, arenas_measured_as_planned, train_saved
from search_common import pinned_knobs

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")

# (ranks, micro-batches, pipeline options)
CONFIGS = [
    (2, 2, "optimizer=adamw stage=3"),
    (3, 3, "optimizer=adamw stage=3 reshard-after-forward=false"),
    (2, 2, "optimizer=adamw stage=3 param-dtype=bf16 max-grad-norm=1.0 recompute=unit"),
    (2, 2, "optimizer=adamw stage=3 offload=optimizer"),
    (2, 3, "optimizer=sgd momentum=0.9 stage=3 accum-reduce=microbatch backward-prefetch=post"),
    (4, 2, "optimizer=adamw stage=3 reshard-after-forward=2"),
]


def main():
    bindir, src = sys.argv[1], sys.argv[2]
    sim = os.path.join(src, "tools", "fsdp-sim", "fsdp-sim")
    report = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "gpt4.mlir")
        subprocess.run([sys.executable, GEN, "gpt", "--vocab", "64", "--ctx", "16", "--layers",
                        "4", "--heads", "2", "--width", "16", "--batch", "4", "-o", model],
                       check=True)

        def compile_(tag, n, pipeline):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} {pipeline} plan={plan} "
                                "report=false"], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"fsdp-opt failed ({tag}): {r.stderr}")
            with open(plan) as f:
                return plan, json.load(f), r.stderr

        def train(plan, n, tag):
            return train_saved(bindir, plan, n, os.path.join(tmp, tag + ".safetensors"))

        def gathers(plan):
            return sum(1 for i in plan["program"] if i["op"] == "all_gather")

        for i, (n, k, pipeline) in enumerate(CONFIGS):
            runs, plans = {}, {}
            for rab in ("true", "false"):
                tag = f"c{i}-{rab}"
                path, plans[rab], _ = compile_(tag, n, f"{pipeline} grad-accum={k} "
                                                       f"reshard-after-backward={rab}")
                runs[rab] = train(path, n, tag)
            what = f"n={n} K={k} {pipeline}"
            (lt, pt, st), (lf, pf, sf) = runs["true"], runs["false"]
            report(lt == lf and pt == pf and len(lf) == 4,
                   f"(a) {what}: losses {' '.join(f'{x:.6f}' for x in lf)} and parameters "
                   "bitwise reshard-after-backward=true's")
            report(all(arenas_measured_as_planned(runs[r][2], plans[r]) for r in runs),
                   f"(b) {what}: arenas measured == planned (true, false)")
            u = len(plans["true"]["units"])  # every unit of the GPT is read in its forward
            gt, gf = gathers(plans["true"]), gathers(plans["false"])
            once = "reshard-after-forward=false" in pipeline
            ok = gt - gf == (k - 1) * u and (gf == u if once else True) and u > 0
            report(ok and sf["comm_bytes_per_step"] < st["comm_bytes_per_step"],
                   f"(c) {what}: all-gathers {gt} -> {gf} ((K-1) x {u} fewer"
                   + (", one a unit" if once else "") + "), bytes a step "
                   f"{st['comm_bytes_per_step']} -> {sf['comm_bytes_per_step']}")

        # --- (d) the cost model and the search. -------------------------------
        base = "optimizer=adamw stage=3 grad-accum=2 param-dtype=bf16 device-profile=h100"
        step = {}
        agree = True
        for rab in ("true", "false"):
            path, _, err = compile_(f"sim-{rab}", 2, f"{base} reshard-after-backward={rab} "
                                                     "simulate=true")
            cxx = float(re.search(r"\n  step\s+([0-9.]+) ms", err).group(1))
            s = json.loads(subprocess.run([sim, path, "--json"], check=True, capture_output=True,
                                          text=True).stdout)
            agree = agree and abs(cxx - s["step_ms"]) <= 6e-4
            step[rab] = s["step_ms"]
        report(step["false"] < step["true"] and agree,
               f"(d) 2 ranks, 2 micro-batches (h100): predicted step {step['true']:.4f} ms -> "
               f"{step['false']:.4f} ms without resharding after backward; fsdp-opt and "
               "fsdp-sim agree")
        _, chosen, _ = compile_("search", 2, f"{base} memory-budget=1GiB")
        st = chosen.pop("strategy")
        _, hand, _ = compile_("search-hand", 2, f"{base} {pinned_knobs(st)}")
        hand.pop("strategy", None)
        _, single, _ = compile_("search-one", 2, "optimizer=adamw stage=3 param-dtype=bf16 "
                                                 "memory-budget=1GiB")
        report(st["reshard_after_backward"] is False and chosen == hand and
               single["strategy"]["reshard_after_backward"] is True,
               f"(d) memory-budget=1GiB with 2 micro-batches: the search chooses "
               f"reshard-after-backward={str(st['reshard_after_backward']).lower()}, the hand "
               f"plan {'exactly' if chosen == hand else 'NOT'}; one micro-batch: "
               f"{str(single['strategy']['reshard_after_backward']).lower()}")
    return report.finish("all reshard-after-backward checks passed")


if __name__ == "__main__":
    sys.exit(main())
