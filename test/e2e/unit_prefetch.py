#!/usr/bin/env python3
"""Per-unit prefetch depth (fsdp-schedule's unit-prefetch-depth, FSDP2's
per-module prefetch) and the memory-budget search's use of it.

usage: unit_prefetch.py BIN_DIR SRC_DIR

A GPT of 4 layers at stage 3 (2 to 4 ranks; recomputation with
accumulation, bf16 at depth 2, BACKWARD_POST, hpZ with qwZ). For every configuration
below, each
per-unit variant (UNIT=D, and UNIT=F/B: forward and backward apart)
against the uniform schedule:
(a) the losses of 4 steps and the final parameters (--save) are bitwise
    equal (only the gathers' places move; every rank issues the
    collectives in the same order);
(b) fsdp-run measures the arenas equal to the plan;
(c) the same instructions, reordered; a unit less deep plans no more
    peak live bytes, and one deeper no fewer;
Then the search, on the same GPT with every other knob pinned (depth 1,
pre):
(d) at a budget one byte under the uniform schedule's arena it chooses a
    unit-prefetch-depth that fits, and its plan is the one compiled by
    hand with that option; with search-unit-prefetch=false nothing fits;
    the peak is at the backward's start, so only backward gathers are
    made less deep (UNIT=1/0: the forward keeps its prefetch);
(d2) with depth 2 pinned, at depth 1's uniform arena - 1, a pass still
    in flight over the budget at depth 1 goes on to 0: the plan fits, is
    the hand plan, and trains bitwise as the uniform schedule at its
    planned arena;
(e) fsdp-opt simulate=true and fsdp-sim agree on the chosen plan, and
    its predicted step lies between depth 1's and depth 0's;
(f) a 7B-shaped GPT at 8 ranks in 22 GiB (bf16, h100): the search
    chooses per-unit depth, predicted faster than the best schedule
    without it.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

from e2e_lib import (Checks, arenas_measured_as_planned, load_json, pipeline_compiler,
                     train_saved)
from search_common import pinned_knobs

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")

# (ranks, pipeline options, per-unit variants)
CONFIGS = [
    (2, "optimizer=adamw stage=3",
     ["transformer.h.3=0", "transformer.h.2=0,transformer.h.3=0", "transformer.h.2=2",
      "transformer.h.2=1/0,transformer.h.3=1/0", "transformer.h.1=0/1"]),
    # The second micro-batch's forward gathers are prefetched into the
    # first's backward, and the recomputation's gathers are the backward's.
    (3, "optimizer=adamw stage=3 recompute=unit grad-accum=2",
     ["transformer.h.3=0,transformer.h.0=0", "transformer.h.0=1/0,transformer.h.3=0/1"]),
    (2, "optimizer=adamw stage=3 param-dtype=bf16 prefetch-depth=2 max-grad-norm=1.0",
     ["transformer.h.3=1", "transformer.h.1=0,transformer.h.2=1", "transformer.h.2=2/1"]),
    # BACKWARD_POST: a unit's backward depth sets how far back post waits.
    (2, "optimizer=adamw stage=3 backward-prefetch=post",
     ["transformer.h.2=1/0", "transformer.h.1=0/1,transformer.h.3=0"]),
    # hpZ's gathers within groups of 2 and qwZ's quantized gathers.
    (4, "optimizer=adamw stage=3 reshard-after-forward=2 weight-quantization=int8",
     ["transformer.h.3=0,transformer.h.1=0"]),
]


def depths(spec, default):
    """The depths, forward's and backward's of each unit, of a
    unit-prefetch-depth value (UNIT=D or UNIT=F/B); `default` elsewhere."""
    d = {f"transformer.h.{i}{p}": default for i in range(4) for p in ("/f", "/b")}
    for entry in spec.split(","):
        unit, value = entry.rsplit("=", 1)
        f, _, b = value.partition("/")
        d[unit + "/f"], d[unit + "/b"] = int(f), int(b or f)
    return d


def main():
    bindir, src = sys.argv[1], sys.argv[2]
    sim = os.path.join(src, "tools", "fsdp-sim", "fsdp-sim")
    report = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "gpt4.mlir")
        subprocess.run([sys.executable, GEN, "gpt", "--vocab", "64", "--ctx", "16", "--layers",
                        "4", "--heads", "2", "--width", "16", "--batch", "4", "-o", model],
                       check=True)

        compile_ = pipeline_compiler(bindir, tmp, model)
        bases = []  # each configuration's uniform run
        load = load_json

        for i, (n, pipeline, variants) in enumerate(CONFIGS):
            depth = int(re.search(r"prefetch-depth=(\d+)", pipeline).group(1)) \
                if "prefetch-depth" in pipeline else 1
            base_plan, _ = compile_(f"c{i}-uniform", n, pipeline)
            base = train_saved(bindir, base_plan, n, os.path.join(tmp, f"c{i}-u.safetensors"))
            bases.append(base)
            bp = load(base_plan)
            ops = sorted(x["op"] for x in bp["program"])
            for j, spec in enumerate(variants):
                plan, _ = compile_(f"c{i}-{j}", n, f"{pipeline} unit-prefetch-depth={spec}")
                p = load(plan)
                losses, params, summary = train_saved(bindir, plan, n,
                                                      os.path.join(tmp, f"c{i}-{j}.safetensors"))
                report(losses == base[0] and params == base[1] and len(losses) == 4,
                       f"(a) n={n} {pipeline} unit-prefetch-depth={spec}: losses "
                       f"{' '.join(f'{x:.6f}' for x in losses)} and parameters bitwise the "
                       "uniform schedule's")
                report(arenas_measured_as_planned(summary, p),
                       f"(b) n={n} unit-prefetch-depth={spec}: arenas measured == planned")
                d = depths(spec, depth)
                shallower = all(v <= depth for v in d.values())
                deeper = all(v >= depth for v in d.values())
                peak, base_peak = p["memory"]["peak_live"], bp["memory"]["peak_live"]
                ordered = (peak <= base_peak if shallower else True) and \
                    (peak >= base_peak if deeper else True)
                report(sorted(x["op"] for x in p["program"]) == ops and
                       p["program"] != bp["program"] and ordered,
                       f"(c) n={n} unit-prefetch-depth={spec}: the same instructions reordered; "
                       f"peak live {peak} vs uniform {base_peak}")

        # --- (d) the search with every other knob pinned. -----------------
        pin = ("optimizer=adamw stage=3 layers-per-unit=1 recompute=none "
               "reshard-after-forward=true prefetch-depth=1 backward-prefetch=pre")
        uniform, _ = compile_("hand-uniform", 2, pin)
        budget = load(uniform)["arena_bytes"] - 1
        chosen, _ = compile_("search", 2, f"{pin} memory-budget={budget}")
        c = load(chosen)
        st = c.pop("strategy")
        hand, _ = compile_("hand-chosen", 2, pinned_knobs(st) + " optimizer=adamw stage=3")
        refused, err = compile_("search-uniform", 2,
                                f"{pin} memory-budget={budget} search-unit-prefetch=false",
                                check=False)
        # The peak is at the backward's start: only backward gathers are
        # made less deep (UNIT=1/0), the forward keeps its prefetch.
        entries = st["unit_prefetch_depth"].split(",")
        report(all(e.endswith("=1/0") for e in entries),
               f"(d) the search's entries {entries} keep the forward's depth 1")
        report(st["unit_prefetch_depth"] != "" and st["prefetch_depth"] == 1 and
               c["arena_bytes"] <= budget and c == load(hand) and
               refused is None and "no schedule fits" in err,
               f"(d) budget {budget} (the uniform arena - 1): the search chooses "
               f"unit-prefetch-depth={st['unit_prefetch_depth']} (arena {c['arena_bytes']}), "
               f"the hand plan {'exactly' if c == load(hand) else 'NOT'}; without it "
               f"{'nothing fits' if refused is None else 'FITS'}")

        # --- (d2) depth 2 pinned, at depth 1's arena - 1: two less deep. ---
        # A unit's pass still in flight over the budget at depth 1 goes on
        # to 0; the plan trains as the uniform one (configuration 0: the
        # same model, ranks and optimizer) at its planned arena.
        pin2 = pin.replace("prefetch-depth=1", "prefetch-depth=2")
        budget2 = load(uniform)["arena_bytes"] - 1
        chosen2, _ = compile_("search2", 2, f"{pin2} memory-budget={budget2}")
        c2 = load(chosen2)
        st2 = c2.pop("strategy")
        hand2, _ = compile_("hand-chosen2", 2, pinned_knobs(st2) + " optimizer=adamw stage=3")
        values = [v for e in st2["unit_prefetch_depth"].split(",")
                  for v in e.rsplit("=", 1)[1].split("/")]
        losses, params, summary = train_saved(bindir, chosen2, 2,
                                              os.path.join(tmp, "search2.safetensors"))
        report(st2["prefetch_depth"] == 2 and "0" in values and c2["arena_bytes"] <= budget2 and
               c2 == load(hand2) and (losses, params) == bases[0][:2] and
               arenas_measured_as_planned(summary, load(chosen2)),
               f"(d2) depth 2 pinned, budget {budget2} (depth 1's arena - 1): the search "
               f"chooses unit-prefetch-depth={st2['unit_prefetch_depth']} (arena "
               f"{c2['arena_bytes']}), the hand plan {'exactly' if c2 == load(hand2) else 'NOT'}; "
               "it trains bitwise as the uniform schedule, measured == planned")

        # --- (e) the cost model on the chosen schedule, GPT-2 at 8 ranks. ----
        gpt2 = os.path.join(src, "examples", "gpt2.mlir")
        step, agree = {}, True
        for tag, opts in (("d1", "prefetch-depth=1"), ("d0", "prefetch-depth=0"),
                          ("unit", "prefetch-depth=1 unit-prefetch-depth="
                                   "transformer.h.11=0,transformer.h.10=0")):
            plan, err = compile_(f"gpt2-{tag}", 8, f"optimizer=adamw param-dtype=bf16 {opts} "
                                 "simulate=true", model=gpt2)
            cxx = float(re.search(r"\n  step\s+([0-9.]+) ms", err).group(1))
            s = json.loads(subprocess.run([sim, plan, "--json"], check=True, capture_output=True,
                                          text=True).stdout)
            agree = agree and abs(cxx - s["step_ms"]) <= 6e-4
            step[tag] = s["step_ms"]
        report(step["d1"] <= step["unit"] <= step["d0"] and agree,
               f"(e) GPT-2 at 8 ranks (h100): predicted step depth 1 {step['d1']:.3f} <= "
               f"two units at 0 {step['unit']:.3f} <= depth 0 {step['d0']:.3f} ms, fsdp-opt "
               "and fsdp-sim agree")

        # --- (f) the search on a 7B shape at 8 ranks. ----------------------
        big = os.path.join(tmp, "7b.mlir")
        subprocess.run([sys.executable, GEN, "gpt", "--vocab", "50257", "--ctx", "4096",
                        "--layers", "32", "--heads", "32", "--width", "4096", "--batch", "1",
                        "-o", big], check=True)
        got = {}
        for flag in ("true", "false"):
            plan, _ = compile_(f"7b-{flag}", 8, "optimizer=adamw param-dtype=bf16 "
                               f"memory-budget=22GiB search-unit-prefetch={flag}", model=big)
            got[flag] = load(plan)["strategy"]
        on, off = got["true"], got["false"]
        report(on["unit_prefetch_depth"] != "" and off["unit_prefetch_depth"] == "" and
               on["predicted_step_s"] < off["predicted_step_s"] and
               on["peak"] <= on["budget"],
               f"(f) 7B shape, 8 ranks, 22 GiB: with per-unit depth "
               f"{on['predicted_step_s'] * 1e3:.2f} ms (unit-prefetch-depth="
               f"{on['unit_prefetch_depth']}), without {off['predicted_step_s'] * 1e3:.2f} ms")
    return report.finish("all unit-prefetch checks passed")


if __name__ == "__main__":
    sys.exit(main())
