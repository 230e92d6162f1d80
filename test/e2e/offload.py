#!/usr/bin/env python3
"""Optimizer offload (offload=optimizer, fsdp-offload): same training, less
device memory.

usage: offload.py BIN_DIR

Moving the master shards, the optimizer state and the update to the host
arena changes where bytes live, not one operation on them: the copies are
exact and the host runs the same update kernel. So, for every
configuration below, against the same plan without offload:
(a) the losses of 6 steps and the final parameters are bitwise equal (a
    run with a 1e-6 relative change of the learning rate is not);
(b) memory: the device arena holds no parameter or optimizer-state storage
    (plan memory.params = memory.state = 0), the host arena holds exactly
    what the device held without offload (memory.host.params / .state),
    the device peak is lower, and fsdp-run measures both arenas' high-water
    and peak live bytes equal to the plan's;
(c) checkpoints: 4 steps with --ckpt-dir, --resume to 8 gives the
    uninterrupted run's losses and parameters bitwise, and the checkpoint
    of the offloaded plan resumes in the plan without offload (the layout
    is the same shards) with the same losses; at stage 2 in f32, where the
    plan without offload keeps whole parameters, `fsdp-ckpt reshard`
    converts it and `--resume` reshards it on load, both bitwise;
(d) refusals: stage 0 (no sharded storage to offload) is refused by name;
(e) evaluation (--eval-every) gives the validation losses bitwise;
(f) overlap (the default): every host update is an async instruction
    joined by a wait on its parameter buffer, one in flight at a time, and
    without clipping or f16 loss scaling (whose coefficient and overflow
    check need every gradient) device compute of the backward pass follows
    the first one, so the host updates run beside the backward pass; (a) and (b) above hold
    for these plans (the runtime's host stream runs them), and the plan
    compiled with overlap=false trains bitwise the same.
(g) offload-next-step=true: every async host update is joined in the
    next step instead (one "carried" wait, placed before the first
    instruction that touches the update's buffers, and no wait in its own
    step), the plan trains bitwise as without offload (losses and final
    parameters), both arenas are measured == predicted, the host arena
    holds every update's operands through the step (at least as large as
    with overlap), and checkpoints (resumed bitwise) and evaluation
    (validation losses bitwise) join the updates the last step left.
"""
import json
import os
import subprocess
import sys
import tempfile

from e2e_lib import Checks, arenas_as_planned

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")

# (model, ranks, pipeline options)
CONFIGS = [
    ("mlp", 1, "optimizer=adamw stage=3"),
    ("mlp", 2, "optimizer=adamw stage=3 reshard-after-forward=false max-grad-norm=0.5"),
    ("mlp", 3, "optimizer=sgd momentum=0.9 stage=2"),
    ("mlp", 2, "optimizer=adamw stage=1 param-dtype=bf16 grad-accum=2"),
    ("mlp", 4, "optimizer=adamw stage=3 mesh=2x2"),
    ("mlp", 2, "optimizer=adamw stage=3 grad-accum=2 accum-reduce=microbatch"),
    ("gpt", 4, "optimizer=adamw stage=3 reshard-after-forward=2 recompute=unit "
               "weight-decay-params=matrices"),
    ("gpt", 2, "optimizer=adamw stage=3 param-dtype=f16"),
    # LAMB: both halves on the host, the norms' all-reduce on the device
    ("gpt", 2, "optimizer=lamb stage=3 max-grad-norm=1.0 weight-decay=0.1 "
               "weight-decay-params=matrices param-dtype=bf16"),
]


def main():
    bindir = sys.argv[1]
    report = Checks()

    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name, args in (("mlp", ["mlp", "--hidden", "64", "--blocks", "4", "--batch", "16"]),
                           ("gpt", ["gpt", "--vocab", "64", "--ctx", "8", "--layers", "2",
                                    "--heads", "2", "--width", "16", "--batch", "4"])):
            models[name] = os.path.join(tmp, name + ".mlir")
            subprocess.run([sys.executable, GEN] + args + ["-o", models[name]], check=True)

        def compile_(model, n, pipeline, offload, tag, check=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                                f"--fsdp-pipeline=world-size={n} {pipeline} offload={offload} "
                                f"plan={plan} report=false"],
                               capture_output=True, text=True, check=check)
            return plan if r.returncode == 0 else r.stderr

        def train(plan, n, *extra):
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json",
                                  "--threads", "1", "--lr", "1e-2"] + list(extra)
                                 + (["--nproc", str(n)] if n > 1 else []),
                                 check=True, capture_output=True, text=True, timeout=300).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            losses = [r["loss"] for r in rows if "step" in r and "loss" in r]
            summary = [r for r in rows if r.get("summary")][0]
            return losses, summary

        def read(path):
            with open(path, "rb") as f:
                return f.read()

        for i, (model, n, pipeline) in enumerate(CONFIGS):
            what = f"{model} N={n} {pipeline}"
            base = compile_(model, n, pipeline, "none", f"c{i}-none")
            off = compile_(model, n, pipeline, "optimizer", f"c{i}-off")
            ref, _ = train(base, n, "--steps", "6", "--save", base + ".st")
            got, s = train(off, n, "--steps", "6", "--save", off + ".st")
            # (a)
            report(got == ref and len(got) == 6, f"(a) {what}: losses bitwise equal")
            if i == 0:
                # The comparison catches a 1e-6 relative change of the lr.
                moved, _ = train(off, n, "--steps", "6", "--lr", repr(1e-2 * (1 + 1e-6)))
                report(moved != ref, f"(a) {what}: lr * (1 + 1e-6) is caught")
            report(read(base + ".st") == read(off + ".st"),
                   f"(a) {what}: final parameters bitwise equal")
            # (b)
            pb, po = json.load(open(base)), json.load(open(off))
            mb, mo = pb["memory"], po["memory"]
            host = mo.get("host", {})
            # Every unit is trainable here: each is offloaded, and the host
            # keeps its f32 master shard (stage 3, and stages 1/2 with bf16,
            # moved the device's shards; stages 1/2 in f32 kept whole
            # parameters on the device, of which the host keeps 1/S).
            units = po["units"]
            want = sum(4 * u["shard_numel"] for u in units)
            moved = (all(u.get("offloaded") for u in units) and
                     mo["params"] == 0 and mo["state"] == 0 and
                     host.get("params") == want and host.get("state") == mb["state"])
            report(moved, f"(b) {what}: device params/state 0, host holds "
                          f"{host.get('params')} + {host.get('state')} B (expected {want} + "
                          f"{mb['state']})")
            report(mo["peak_live"] < mb["peak_live"],
                   f"(b) {what}: device peak live {mo['peak_live']} < {mb['peak_live']} B")
            measured = arenas_as_planned(s, po)
            report(measured, f"(b) {what}: measured == predicted, device "
                             f"{s['measured_high_water']} B and host "
                             f"{s['measured_host_high_water']} B")
            # (f)
            prog = po["program"]
            bufs = po["buffers"]
            ups = [k for k, x in enumerate(prog)
                   if x["op"] in ("adamw_update", "sgd_update", "sgd_momentum_update",
                                  "lamb_update") and bufs[x["out"][0]].get("space") == "host"]
            joined = True
            for j, k in enumerate(ups):
                waits = [w for w, x in enumerate(prog) if w > k and x["op"] == "wait"
                         and x["in"][0] == prog[k]["out"][0]]
                nxt = ups[j + 1] if j + 1 < len(ups) else len(prog)
                joined &= bool(prog[k].get("attrs", {}).get("async")) and bool(waits) \
                    and waits[0] < nxt
            # Device compute issued after the first update: the backward
            # pass it runs beside.
            beside = sum(1 for x in prog[ups[0] + 1:] if ups and x["op"] not in
                         ("wait", "to_host", "to_device", "all_gather", "reduce_scatter",
                          "all_reduce") and bufs[x["out"][0]].get("space") != "host")
            # Clipping's coefficient and f16's overflow check need every
            # gradient: the updates come after them.
            clipped = "max-grad-norm" in pipeline or "f16" in pipeline.replace("bf16", "")
            report(len(ups) > 0 and joined and (beside > 0 or clipped),
                   f"(f) {what}: {len(ups)} async host updates, each joined before the next; "
                   + ("issued after the clipping coefficient / overflow check" if clipped else
                      f"{beside} device instructions after the first"))
            if i in (0, 6):
                serial = compile_(model, n, pipeline + " overlap=false", "optimizer",
                                  f"c{i}-serial")
                got2, _ = train(serial, n, "--steps", "6", "--save", serial + ".st")
                sp = json.load(open(serial))["program"]
                report(got2 == ref and read(serial + ".st") == read(base + ".st") and
                       not any(x.get("attrs", {}).get("async") for x in sp),
                       f"(f) {what}: overlap=false (nothing async) trains bitwise the same")

            # (g)
            carry = compile_(model, n, pipeline + " offload-next-step=true", "optimizer",
                             f"c{i}-next")
            got3, s3 = train(carry, n, "--steps", "6", "--save", carry + ".st")
            pc = json.load(open(carry))
            cp, cb = pc["program"], pc["buffers"]
            cups = [k for k, x in enumerate(cp) if x.get("attrs", {}).get("async")
                    and x["op"] not in ("to_host", "to_device", "all_gather", "reduce_scatter",
                                        "all_reduce") and cb[x["out"][0]].get("space") == "host"]
            placed = bool(cups)
            for k in cups:
                b = cp[k]["out"][0]
                joins = [w for w, x in enumerate(cp) if x["op"] == "wait" and x["in"][0] == b]
                touched = set(cp[k]["in"]) | set(cp[k]["out"])
                first = min(j for j, x in enumerate(cp) if x["op"] != "wait"
                            and touched & (set(x["in"]) | set(x["out"])))
                placed &= (len(joins) == 1 and joins[0] < k and joins[0] <= first and
                           cp[joins[0]]["attrs"].get("carried") is True)
            measured3 = (s3["measured_high_water"] == s3["predicted_peak"] and
                         s3["measured_host_high_water"] == s3["predicted_host_peak"] and
                         s3["measured_host_peak_live"] == s3["predicted_host_peak_live"])
            report(got3 == ref and read(carry + ".st") == read(base + ".st") and placed and
                   measured3 and pc["host_arena_bytes"] >= po["host_arena_bytes"],
                   f"(g) {what}: {len(cups)} host updates joined in the next step, trains "
                   f"bitwise the same, host arena {pc['host_arena_bytes']} B (overlap: "
                   f"{po['host_arena_bytes']} B) measured == predicted")

        # (g) checkpoints and evaluation join what the last step left.
        model, n, pipeline = CONFIGS[6]
        carry = os.path.join(tmp, "c6-next.plan")
        ref, _ = train(carry, n, "--steps", "8", "--save", carry + ".ref.st")
        ck = os.path.join(tmp, "ck6-next")
        train(carry, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "2")
        after, _ = train(carry, n, "--steps", "8", "--resume", ck, "--save", carry + ".res.st")
        report(after == ref[4:] and read(carry + ".ref.st") == read(carry + ".res.st"),
               f"(g) {model} N={n} offload-next-step: resumed losses 5-8 and final parameters "
               f"bitwise equal")

        # (c) checkpoints, on the 2-rank bf16 stage-1 and the hpZ GPT plans.
        for i in (3, 6):
            model, n, pipeline = CONFIGS[i]
            off = os.path.join(tmp, f"c{i}-off.plan")
            base = os.path.join(tmp, f"c{i}-none.plan")
            ref, _ = train(off, n, "--steps", "8", "--save", off + ".ref.st")
            ck = os.path.join(tmp, f"ck{i}")
            train(off, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "2")
            after, _ = train(off, n, "--steps", "8", "--resume", ck, "--save", off + ".res.st")
            report(after == ref[4:], f"(c) {model} N={n}: resumed losses 5-8 bitwise equal")
            report(read(off + ".ref.st") == read(off + ".res.st"),
                   f"(c) {model} N={n}: resumed final parameters bitwise equal")
            other, _ = train(base, n, "--steps", "8", "--resume", ck)
            report(other == ref[4:], f"(c) {model} N={n}: the offloaded checkpoint resumes "
                                     f"without offload, losses bitwise equal")

        # (c) stages 1/2 in f32: offload keeps the master shard where the
        # plan without it keeps whole parameters: another layout, which
        # `--resume` reshards on load and `fsdp-ckpt reshard` converts.
        model, n, pipeline = CONFIGS[2]
        off, base = (os.path.join(tmp, f"c2-{t}.plan") for t in ("off", "none"))
        ref, _ = train(off, n, "--steps", "8")
        ck, ckr = os.path.join(tmp, "ck2"), os.path.join(tmp, "ck2r")
        train(off, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "4")
        subprocess.run([os.path.join(bindir, "fsdp-ckpt"), "reshard", ck, "--plan", base, ckr],
                       check=True, capture_output=True)
        after, _ = train(base, n, "--steps", "8", "--resume", ckr, "--save", ckr + ".st")
        report(after == ref[4:], f"(c) {model} N={n} {pipeline}: resharded for the plan "
                                 f"without offload, losses 5-8 bitwise equal")
        online, summary = train(base, n, "--steps", "8", "--resume", ck, "--save", ck + ".st")
        report(online == ref[4:] and summary["resumed"]["resharded"]
               and read(ck + ".st") == read(ckr + ".st"),
               f"(c) {model} N={n} {pipeline}: resharded on load by the plan without offload, "
               f"losses 5-8 and final parameters bitwise equal")

        # (e) evaluation: the forward slice copies the offloaded shards too.
        vals = {}
        for off in ("none", "optimizer", "next"):
            plan = compile_("gpt", 2, "optimizer=adamw stage=3 max-grad-norm=1.0"
                            + (" offload-next-step=true" if off == "next" else ""),
                            "optimizer" if off == "next" else off, f"ev-{off}")
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json", "--threads",
                                  "1", "--steps", "4", "--eval-every", "2", "--nproc", "2"],
                                 check=True, capture_output=True, text=True, timeout=300).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            vals[off] = [r["val_loss"] for r in rows if r.get("eval")]
        report(len(vals["none"]) == 3 and vals["none"] == vals["optimizer"],
               f"(e) gpt N=2: validation losses bitwise equal ({len(vals['none'])} evaluations)")
        report(vals["next"] == vals["none"],
               "(g) gpt N=2 offload-next-step: validation losses bitwise equal")

        # (d)
        err = compile_("mlp", 2, "optimizer=adamw stage=0", "optimizer", "s0", check=False)
        line = [l for l in err.splitlines() if "offload" in l]
        report(bool(line) and "needs trainable units with sharded storage" in line[0],
               "(d) stage 0 refused: " + (line[0].split("error: ")[-1][:90] if line else err))

    return report.finish("all offload checks passed")


if __name__ == "__main__":
    sys.exit(main())
