#!/usr/bin/env python3
"""Where the backward pass's all-gathers are issued (backward-prefetch,
FSDP's BackwardPrefetch): pre (BACKWARD_PRE, the default), post
(BACKWARD_POST: once the parameters of the unit before in backward order
are dead) or none (where they are read).

usage: backward_prefetch.py BIN_DIR SRC_DIR

A GPT of 4 layers at stage 3. For every configuration below, post and
none against pre:
(a) the losses of 4 steps and the final parameters (--save) are bitwise
    equal (only the order of the gathers moves; every rank issues the
    collectives in the same order);
(b) fsdp-run measures the arenas (offloaded: both) equal to the plan;
(c) the plan's peak live bytes: none <= post <= pre, and on the first
    configuration post < pre (its peak is where the backward starts,
    which pre enters holding the next unit's gathered parameters);
(d) the plans differ from pre's in order only (same instructions; on one
    rank, which gathers nothing, not at all).
Then the cost model, on a GPT-2-shaped model at 8 ranks (h100 profile):
(e) predicted step pre <= post <= none and post < none, fsdp-opt
    simulate=true and fsdp-sim agree on each;
and the memory-budget search, with the other knobs pinned:
(f) at a budget of post's peak it chooses backward-prefetch=post (the
    plan equal to the hand-compiled one), where pinned uniform pre finds
    nothing that fits (pre with a unit less deep fits, no faster); at a
    budget of pre's peak it chooses pre (as fast or faster);
(g) on the GPT-3 175B shape at 64 ranks (bf16, h100): weighing post never
    gives a slower choice than the search with pre pinned (80 GiB: the
    same step), and at 64 GiB, where uniform pre needs prefetch-depth 0
    (search-unit-prefetch=false), the search keeps depth 1 with post,
    more than 5% faster; pre pinned keeps prefetching too (depth 1 or
    2), with the units' passes prefetched over the budget less deep
    (unit-prefetch-depth), more than 3% faster than its depth 0 and
    slower than post.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

from e2e_lib import (Checks, arenas_measured_as_planned, load_json, pipeline_compiler,
                     train_saved)

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")

# (ranks, pipeline options)
CONFIGS = [
    (2, "optimizer=adamw stage=3"),
    (3, "optimizer=adamw stage=3 recompute=unit grad-accum=2"),
    (2, "optimizer=adamw stage=3 param-dtype=bf16 max-grad-norm=1.0"),
    (2, "optimizer=adamw stage=3 offload=optimizer"),
    (2, "optimizer=sgd momentum=0.9 stage=3 reshard-units=2 prefetch-depth=2"),
    (1, "optimizer=adamw stage=3 recompute=selective"),
]
MODES = ("pre", "post", "none")


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
        load = load_json

        def train(plan, n, tag):
            return train_saved(bindir, plan, n, os.path.join(tmp, tag + ".safetensors"))

        for i, (n, pipeline) in enumerate(CONFIGS):
            runs, plans = {}, {}
            for mode in MODES:
                tag = f"c{i}-{mode}"
                plan, _ = compile_(tag, n, f"{pipeline} backward-prefetch={mode}")
                plans[mode] = load(plan)
                runs[mode] = train(plan, n, tag)
            base = runs["pre"]
            for mode in ("post", "none"):
                losses, params, summary = runs[mode]
                report(losses == base[0] and params == base[1] and len(losses) == 4,
                       f"(a) n={n} {pipeline} backward-prefetch={mode}: losses "
                       f"{' '.join(f'{x:.6f}' for x in losses)} and parameters bitwise pre's")
            report(all(arenas_measured_as_planned(runs[m][2], plans[m]) for m in MODES),
                   f"(b) n={n} {pipeline}: arenas measured == planned (pre, post, none)")
            peak = {m: plans[m]["memory"]["peak_live"] for m in MODES}
            ordered = peak["none"] <= peak["post"] <= peak["pre"]
            if i == 0:
                ordered = ordered and peak["post"] < peak["pre"]
            report(ordered, f"(c) n={n} {pipeline}: peak live bytes none {peak['none']} <= post "
                            f"{peak['post']} <= pre {peak['pre']}" + (" (post < pre)" if i == 0 else ""))
            ops = {m: [x["op"] for x in plans[m]["program"]] for m in MODES}
            moved = ops["post"] != ops["pre"] and ops["none"] != ops["pre"]
            report(all(sorted(ops[m]) == sorted(ops["pre"]) for m in MODES) and
                   (moved if n > 1 else plans["post"] == plans["pre"] == plans["none"]),
                   f"(d) n={n} {pipeline}: " +
                   ("post and none reorder pre's instructions, nothing else" if n > 1 else
                    "one rank gathers nothing: the three plans are one"))

        # --- (e) the cost model on a GPT-2 shape at 8 ranks. ------------------
        gpt2 = os.path.join(src, "examples", "gpt2.mlir")
        step = {}
        agree = True
        for mode in MODES:
            plan, err = compile_(f"gpt2-{mode}", 8, "optimizer=adamw param-dtype=bf16 "
                                 f"backward-prefetch={mode} simulate=true", model=gpt2)
            cxx = float(re.search(r"\n  step\s+([0-9.]+) ms", err).group(1))
            s = json.loads(subprocess.run([sim, plan, "--json"], check=True, capture_output=True,
                                          text=True).stdout)
            agree = agree and abs(cxx - s["step_ms"]) <= 6e-4
            step[mode] = s["step_ms"]
        report(step["pre"] <= step["post"] <= step["none"] and step["post"] < step["none"] and agree,
               f"(e) GPT-2 at 8 ranks (h100): predicted step pre {step['pre']:.3f} <= post "
               f"{step['post']:.3f} < none {step['none']:.3f} ms, fsdp-opt and fsdp-sim agree")

        # --- (f) the search. ---------------------------------------------------
        pin = "optimizer=adamw stage=3 layers-per-unit=1 recompute=none " \
              "reshard-after-forward=true prefetch-depth=1"
        hand = {m: compile_(f"hand-{m}", 2, f"{pin} backward-prefetch={m}")[0]
                for m in ("pre", "post")}
        arena = {m: load(hand[m])["arena_bytes"] for m in hand}
        chosen, _ = compile_("search-post", 2, f"{pin} memory-budget={arena['post']}")
        c = load(chosen)
        st = c.pop("strategy")
        same = c == load(hand["post"])
        refused, err = compile_("search-pinned-pre", 2,
                                f"{pin} backward-prefetch=pre memory-budget={arena['post']} "
                                "search-unit-prefetch=false", check=False)
        per_unit, _ = compile_("search-pinned-pre-unit", 2,
                               f"{pin} backward-prefetch=pre memory-budget={arena['post']}")
        pu = load(per_unit)["strategy"]
        report(arena["post"] < arena["pre"] and st["backward_prefetch"] == "post" and same and
               refused is None and "no schedule fits" in err and pu["unit_prefetch_depth"] and
               st["predicted_step_s"] <= pu["predicted_step_s"],
               f"(f) budget {arena['post']} (post's arena; pre's {arena['pre']}): the search "
               f"chooses backward-prefetch={st['backward_prefetch']}, the hand plan "
               f"{'exactly' if same else 'NOT'}; pinned uniform pre: "
               f"{'nothing fits' if refused is None else 'FITS'}; pinned pre fits with "
               f"unit-prefetch-depth={pu['unit_prefetch_depth']}, no faster")
        loose, _ = compile_("search-pre", 2, f"{pin} memory-budget={arena['pre']}")
        sl = load(loose)["strategy"]
        report(sl["backward_prefetch"] == "pre",
               f"(f) budget {arena['pre']} (pre's arena): the search chooses "
               f"backward-prefetch={sl['backward_prefetch']}")

        # --- (g) the search on the 175B shape at 64 ranks. ----------------------
        big = os.path.join(tmp, "175b.mlir")
        subprocess.run([sys.executable, GEN, "gpt", "--vocab", "50257", "--ctx", "2048",
                        "--layers", "96", "--heads", "96", "--width", "12288", "--batch", "1",
                        "-o", big], check=True)
        uniform = "backward-prefetch=pre search-unit-prefetch=false"
        for budget in ("80GiB", "64GiB"):
            got = {}
            for pin in (uniform, "backward-prefetch=pre", ""):
                plan, _ = compile_(f"175b-{budget}-{len(got)}", 64, "optimizer=adamw "
                                   f"param-dtype=bf16 memory-budget={budget} {pin}", model=big)
                got[pin] = load(plan)["strategy"]
            flat, pre, free = got[uniform], got["backward-prefetch=pre"], got[""]
            ms = {k: v["predicted_step_s"] for k, v in got.items()}
            ok = ms[""] <= ms["backward-prefetch=pre"] * (1 + 1e-12) <= ms[uniform] * (1 + 2e-12)
            if budget == "64GiB":  # post at depth 1 fits where pre needs depth 0
                ok = ok and (free["backward_prefetch"] == "post" and free["prefetch_depth"] == 1
                             and flat["prefetch_depth"] == 0 and
                             ms[""] < 0.95 * ms[uniform] and
                             pre["prefetch_depth"] >= 1 and pre["unit_prefetch_depth"] != "" and
                             ms["backward-prefetch=pre"] < 0.97 * ms[uniform])
            report(ok, f"(g) 175B shape, 64 ranks, {budget}: searched "
                       f"{ms[''] * 1e3:.0f} ms (depth {free['prefetch_depth']} "
                       f"{free['backward_prefetch']}), pre pinned "
                       f"{ms['backward-prefetch=pre'] * 1e3:.0f} ms (depth {pre['prefetch_depth']}, "
                       f"{len(pre['unit_prefetch_depth'].split(',')) if pre['unit_prefetch_depth'] else 0}"
                       f" unit(s) less deep), uniform pre {ms[uniform] * 1e3:.0f} ms "
                       f"(depth {flat['prefetch_depth']})")
    return report.finish("all backward-prefetch checks passed")


if __name__ == "__main__":
    sys.exit(main())
