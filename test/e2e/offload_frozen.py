#!/usr/bin/env python3
"""Frozen units' storage on the host (offload=all): same training, no
parameter storage on the device.

usage: offload_frozen.py BIN_DIR

A GPT whose first block is frozen (gen_models.py --frozen-layers 1: a
fine-tune of the top of a model). offload=all does what offload=optimizer
does and also keeps every frozen unit's storage in the host arena, copied
to the device before each use; nothing else changes. For every
configuration below, against the same plan without offload:
(a) the losses of 6 steps and the final parameters (--save) are bitwise
    equal;
(b) memory: every unit is offloaded, the device arena holds no parameter
    or optimizer-state storage (offload=optimizer keeps exactly the frozen
    storage there), the host holds each frozen unit's storage in its
    stored dtype (its shard at stage 3, the whole unit at stages 1/2) and
    each trainable unit's f32 master shard, the device peak live bytes are
    at most offload=optimizer's (equal where the peak holds the frozen
    unit's copy to the device instead), as many copies to the device are
    in flight at most as offload-prefetch-depth says (1 by default; the
    last configuration has 3, and reaches 3), and fsdp-run measures both arenas
    equal to the plan;
(c) 4 steps with checkpoints then --resume to 8 give the uninterrupted
    run's losses and parameters bitwise, and --eval-every gives the
    validation losses of the plan without offload bitwise;
(d) the memory-budget search: with offload=auto and a budget below every
    offload=optimizer schedule's arena it chooses offload=all and fits
    (offload=optimizer pinned: nothing fits); on the same model without
    frozen parameters `all` is no candidate (the floor's schedule is
    offload=optimizer); a misspelt offload is refused by name.
"""
import json
import os
import subprocess
import sys
import tempfile

from e2e_lib import Checks, arenas_as_planned, copies_in_flight

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")

# (ranks, pipeline options)
CONFIGS = [
    (1, "optimizer=adamw stage=3"),
    (2, "optimizer=adamw stage=3 reshard-after-forward=false max-grad-norm=1.0 "
        "offload-next-step=true"),
    (2, "optimizer=adamw stage=2 param-dtype=bf16"),
    (3, "optimizer=sgd momentum=0.9 stage=1"),
    (2, "optimizer=adamw stage=3 recompute=unit grad-accum=2"),
    (2, "optimizer=adamw stage=3 max-grad-norm=1.0 offload-next-step=true "
        "offload-prefetch-depth=3"),
]
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def main():
    bindir = sys.argv[1]
    report = Checks()

    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name, extra in (("frozen", ["--frozen-layers", "1"]), ("plain", [])):
            models[name] = os.path.join(tmp, name + ".mlir")
            subprocess.run([sys.executable, GEN, "gpt", "--vocab", "64", "--ctx", "8", "--layers",
                            "2", "--heads", "2", "--width", "16", "--batch", "4", "-o",
                            models[name]] + extra, check=True)

        def compile_(tag, n, pipeline, model="frozen", check=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} {pipeline} plan={plan} "
                                "report=false"], capture_output=True, text=True)
            if check and r.returncode != 0:
                raise SystemExit(f"fsdp-opt failed ({tag}): {r.stderr}")
            return plan if r.returncode == 0 else r.stderr

        def train(plan, n, *extra):
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json",
                                  "--threads", "1", "--lr", "1e-2"] + list(extra)
                                 + (["--nproc", str(n)] if n > 1 else []),
                                 check=True, capture_output=True, text=True, timeout=300).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            losses = [r["loss"] for r in rows if "step" in r and "loss" in r]
            evals = [r["val_loss"] for r in rows if "val_loss" in r]
            summary = [r for r in rows if r.get("summary")][0]
            return losses, summary, evals

        def read(path):
            with open(path, "rb") as f:
                return f.read()

        for i, (n, pipeline) in enumerate(CONFIGS):
            what = f"N={n} {pipeline}"
            base = compile_(f"c{i}-none", n, pipeline)
            opt = compile_(f"c{i}-opt", n, pipeline + " offload=optimizer")
            off = compile_(f"c{i}-all", n, pipeline + " offload=all")
            ref, _, _ = train(base, n, "--steps", "6", "--save", base + ".st")
            got, s, _ = train(off, n, "--steps", "6", "--save", off + ".st")
            # (a)
            report(len(got) == 6 and got == ref and read(base + ".st") == read(off + ".st"),
                   f"(a) {what}: losses and final parameters bitwise equal")
            # (b)
            po, pp = json.load(open(off)), json.load(open(opt))
            mo, mp = po["memory"], pp["memory"]
            units = po["units"]
            frozen = [u for u in units if u.get("frozen")]
            want = frozen_bytes = 0
            for u in units:
                storage = po["buffers"][u["buffer"]]
                numel = u["shard_numel"] if u.get("sharded") else u["padded_numel"]
                nbytes = numel * (DTYPE_BYTES[storage["dtype"]] if u.get("frozen") else 4)
                want += nbytes
                frozen_bytes += nbytes if u.get("frozen") else 0
            host = mo.get("host", {})
            # fsdp-offload's prefetch (the default without a budget): every
            # copy of offloaded storage to the device is async (copy stream).
            copies = [i for i in po["program"] if i["op"] == "to_device"]
            most = copies_in_flight(po)
            depth = 3 if "offload-prefetch-depth=3" in pipeline else 1
            ok = (frozen and copies and all(i.get("attrs", {}).get("async") for i in copies) and
                  most == depth and all(u.get("offloaded") for u in units) and mo["params"] == 0 and
                  mo["state"] == 0 and host.get("params") == want and
                  mp["params"] == frozen_bytes and mo["peak_live"] <= mp["peak_live"] and
                  arenas_as_planned(s))
            report(ok, f"(b) {what}: {len(frozen)} frozen of {len(units)} units offloaded, "
                       f"{len(copies)} async copies to the device, at most {most} in flight "
                       f"(expected {depth}), device "
                       f"params/state 0, host params {host.get('params')} B (expected {want}; "
                       f"offload=optimizer keeps the frozen {mp['params']} B on the device), "
                       f"device peak live {mo['peak_live']} <= {mp['peak_live']} B, both arenas "
                       "measured == predicted")

        # (c) checkpoints and evaluation, on the next-step plan and the
        # stage-2 bf16 one (whose frozen unit is whole on the host).
        for i in (1, 2):
            n, pipeline = CONFIGS[i]
            off = os.path.join(tmp, f"c{i}-all.plan")
            base = os.path.join(tmp, f"c{i}-none.plan")
            ref, _, _ = train(off, n, "--steps", "8", "--save", off + ".ref.st")
            ck = os.path.join(tmp, f"ck{i}")
            train(off, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "2")
            after, _, _ = train(off, n, "--steps", "8", "--resume", ck, "--save", off + ".res.st")
            report(after == ref[4:] and read(off + ".ref.st") == read(off + ".res.st"),
                   f"(c) N={n} {pipeline}: resumed at step 4, steps 5-8 and the final "
                   "parameters bitwise")
            _, _, ev_off = train(off, n, "--steps", "4", "--eval-every", "2")
            _, _, ev_base = train(base, n, "--steps", "4", "--eval-every", "2")
            report(len(ev_off) >= 2 and ev_off == ev_base,
                   f"(c) N={n} {pipeline}: {len(ev_off)} validation losses bitwise equal")

        # (d) the memory-budget search.
        def arena(plan):
            return json.load(open(plan))["arena_bytes"]

        # (offload-prefetch=false: each copy live only at its use, the
        # smallest arenas; the search weighs both.)
        knobs = [f"recompute={rc} layers-per-unit={lpu} reshard-after-forward={rs} "
                 f"prefetch-depth={d} offload-prefetch=false" for rc in ("none", "selective", "unit")
                 for lpu in (1, 2) for rs in ("true", "false") for d in (0, 1, 2)]
        opt_floor = min(arena(compile_(f"k{j}", 2, f"optimizer=adamw stage=3 offload=optimizer "
                                       f"{k}")) for j, k in enumerate(knobs))
        budget = opt_floor - 1
        chosen = compile_("auto", 2, f"optimizer=adamw stage=3 offload=auto memory-budget={budget}")
        st = json.load(open(chosen))["strategy"]
        pinned = compile_("pinned", 2, f"optimizer=adamw stage=3 offload=optimizer "
                          f"memory-budget={budget}", check=False)
        report(st["offload"] == "all" and arena(chosen) <= budget and
               "no schedule fits" in pinned,
               f"(d) budget {budget} B (offload=optimizer's smallest arena {opt_floor}): "
               f"offload=auto chose {st['offload']}, arena {arena(chosen)}; "
               "offload=optimizer pinned: nothing fits")
        err = compile_("plain-floor", 2, "optimizer=adamw stage=3 offload=auto memory-budget=1KiB",
                       model="plain", check=False)
        bogus = compile_("bogus", 2, "optimizer=adamw stage=3 offload=everything",
                         check=False)
        report("no schedule fits" in err and "offload=optimizer" in err and
               "offload=all" not in err and "must be none, optimizer or all" in bogus,
               "(d) without frozen parameters the floor is offload=optimizer's (all is no "
               "candidate); offload=everything refused by name")

    return report.finish("all frozen-offload checks passed")


if __name__ == "__main__":
    sys.exit(main())
