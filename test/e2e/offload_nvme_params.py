#!/usr/bin/env python3
"""Parameters on disk too (offload-nvme-params=true, ZeRO-Infinity's
offload_param): the master shards of the units whose optimizer state is
on disk live in the swap file beside it, so the host arena holds no
parameter of theirs.

usage: offload_nvme_params.py BIN_DIR

A copy of such storage to the device reads its bytes (the whole blocks
they span) into a staging buffer first and copies from there; the update
swaps the master shard as it swaps the state. Nothing is computed
differently, so for every configuration below, against the same plan
with only the state on disk (offload-nvme=true):
(a) the losses of 6 steps and the final parameters are bitwise equal;
(b) memory: every offloaded trainable unit's storage (with offload=all
    every frozen unit's too) is in the swap file (space "nvme", the
    plan's memory.nvme.params its bytes, none of it in the host arena);
    the host arena loses the master shards less the staging live at
    once; no instruction names a buffer in the file (each copy of it to
    the device names a view of its staging, each update and its join
    the staging); the device arena is the same; fsdp-run measures both
    arenas' high-water and peak live bytes equal to the plan's;
(c) traffic: each step reads exactly every swap's staging bytes (a copy
    of part of a unit: whole blocks from its offset) and writes back the
    updated buffers, a read for every copy of on-disk storage to the
    device;
(d) the reads ahead: the k-th swapping instruction (copies and async
    updates in program order) reads after the (k-R)-th, R = 1 and 2,
    and R = 0 reads at each; bitwise the same training;
(e) checkpoints: 3 steps with --ckpt-dir, --resume to 6 gives the
    uninterrupted run bitwise, and the checkpoint resumes in the plan
    with the parameters in host memory and back, bitwise; --init-from a
    safetensors file of the final parameters loads them into the file
    (the next step's loss is the same in both placements);
(f) refusals: offload-nvme-params without offload-nvme is refused by
    name, by fsdp-opt and by the memory-budget search; a plan with the
    parameters on disk run without --nvme-dir names both and the flag;
(g) the cost model (h100 profile; fsdp-sim and fsdp-opt simulate=true
    agree on the step, the host stream and the drive): the drive is busy
    exactly every staging's bytes at the NVMe read rate plus the written
    ones at the write rate (half and half duplex shares; an update joined
    at once swaps on compute's time, as before), the predicted
    trace reads each copy's blocks before the copy starts (on the copy
    stream, or on compute when the copy is not async), and reading ahead
    (R = 1, 2) predicts a shorter step than R = 0 (the copies' reads
    run beside the previous copies instead of stalling compute); and
    fsdp-run --trace of such a plan (sync and async copies, two ranks,
    four steps): every copy's read on the swap-in thread ends before the
    copy's span on compute does (a CPU device copies in place once the
    read is done), and every update's read before the update starts;
(h) the memory-budget search with offload-nvme-params=auto: under a
    host-memory-budget between the leanest host arena with the shards on
    disk and the leanest without, it puts them on disk (strategy
    offload_nvme_params) within the budget, and that plan trains bitwise
    as the state-on-disk plan; with room for the shards in host memory it
    keeps them there; below both it fails naming a floor no higher than
    the leanest plan with the shards on disk.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

from e2e_lib import Checks, arenas_as_planned, gen_models, run_json

# (model, ranks, pipeline options)
CONFIGS = [
    ("mlp", 1, "optimizer=adamw stage=3"),
    ("mlp", 2, "optimizer=adamw stage=3 max-grad-norm=0.5"),
    ("mlp", 3, "optimizer=sgd momentum=0.9 stage=2"),
    ("mlp", 2, "optimizer=adamw stage=3 offload-overlap=false offload-prefetch=false"),
    ("gpt", 2, "optimizer=adamw stage=3 param-dtype=bf16 recompute=unit "
               "weight-decay-params=matrices"),
    ("gpt", 2, "optimizer=lamb stage=3 max-grad-norm=1.0 weight-decay=0.1 "
               "weight-decay-params=matrices"),
    ("gpt", 2, "optimizer=adamw stage=3 max-grad-norm=1.0 offload-next-step=true"),
    ("gpt", 1, "optimizer=adamw stage=3 offload-prefetch-depth=2"),
    ("frozen", 2, "optimizer=adamw stage=3 param-dtype=bf16 offload=all"),
]


def main():
    bindir = sys.argv[1]
    report = Checks()

    with tempfile.TemporaryDirectory() as tmp:
        models = gen_models(tmp, {
            "mlp": ["mlp", "--hidden", "256", "--blocks", "4", "--batch", "16"],
            "gpt": ["gpt", "--vocab", "64", "--ctx", "8", "--layers", "2", "--heads", "2",
                    "--width", "64", "--batch", "4"],
            "frozen": ["gpt", "--vocab", "64", "--ctx", "8", "--layers", "2", "--heads", "2",
                       "--width", "64", "--batch", "4", "--frozen-layers", "1"]})
        swapdir = os.path.join(tmp, "nvme")
        os.mkdir(swapdir)

        def fsdp_opt(model, n, pipeline, plan=None):
            return subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o",
                                   os.devnull, f"--fsdp-pipeline=world-size={n} {pipeline} "
                                   + (f"plan={plan} " if plan else "") + "report=false"],
                                  capture_output=True, text=True)

        def compile_(model, n, pipeline, params, tag, extra=""):
            plan = os.path.join(tmp, tag + ".plan")
            off = "" if "offload=" in pipeline else "offload=optimizer "
            r = fsdp_opt(model, n, f"{pipeline} {off}offload-nvme=true "
                         f"offload-nvme-params={'true' if params else 'false'} {extra}", plan)
            if r.returncode != 0:
                raise SystemExit(f"fsdp-opt failed ({tag}): {r.stderr}")
            return plan

        def train(plan, n, *extra):
            return run_json(bindir, plan, n, "--threads", "1", "--lr", "1e-2", "--nvme-dir",
                            swapdir, *extra)

        def read(path):
            with open(path, "rb") as f:
                return f.read()

        def swapping(p):
            return [(i, x) for i, x in enumerate(p["program"]) if x.get("attrs", {}).get("swap")]

        for i, (model, n, pipeline) in enumerate(CONFIGS):
            what = f"{model} N={n} {pipeline}"
            state = compile_(model, n, pipeline, False, f"c{i}-state")
            both = compile_(model, n, pipeline, True, f"c{i}-both")
            ref, ss = train(state, n, "--steps", "6", "--save", state + ".st")
            got, s = train(both, n, "--steps", "6", "--save", both + ".st")
            # (a)
            report(got == ref and len(got) == 6 and read(state + ".st") == read(both + ".st"),
                   f"(a) {what}: losses and final parameters bitwise equal")
            # (b)
            ps, pb = json.load(open(state)), json.load(open(both))
            bufs = pb["buffers"]
            units = [u for u in pb["units"] if u.get("offloaded")]
            stored = [bufs[u["buffer"]] for u in units]
            on_disk = bool(stored) and all(b.get("space") == "nvme" for b in stored)
            master = sum(b["bytes"] for b in stored)
            named = [x for x in pb["program"] for ids in (x["in"], x["out"]) for b in ids
                     if bufs[b].get("space") == "nvme"]
            staging_more = pb["memory"]["host"]["staging"] - ps["memory"]["host"]["staging"]
            nextstep = "next-step" in pipeline
            shrunk = (pb["host_arena_bytes"] <= ps["host_arena_bytes"] - master + staging_more
                      + 2 * 4096 * len(swapping(pb)))
            report(on_disk and pb["memory"]["nvme"]["params"] == master and
                   pb["memory"]["host"]["params"] == 0 and not named and shrunk and
                   pb["arena_bytes"] == ps["arena_bytes"],
                   f"(b) {what}: {len(stored)} units' storage ({master} B) in the swap file, "
                   f"no instruction names it; host arena {pb['host_arena_bytes']} B (with the "
                   f"master shards in it: {ps['host_arena_bytes']} B, staging "
                   f"+{staging_more} B{', next-step keeps every staging live' if nextstep else ''})")
            measured = arenas_as_planned(s, pb)
            report(measured, f"(b) {what}: measured == predicted, device "
                             f"{s['measured_high_water']} B and host "
                             f"{s['measured_host_high_water']} B")
            # (c)
            swaps = [(x, sw) for _, x in swapping(pb) for sw in x["attrs"]["swap"]]
            rd = sum(bufs[sw[1]]["bytes"] for _, sw in swaps)
            wr = sum(bufs[sw[0]]["bytes"] for _, sw in swaps if sw[2])
            disk_ids = {b["id"] for b in stored}
            copies = [x for x in pb["program"] if x["op"] == "to_device" and
                      any(sw[0] in disk_ids for sw in x.get("attrs", {}).get("swap", []))]
            reads_copy = all(all(not sw[2] for sw in x["attrs"]["swap"]) for x in copies)
            # (the same copies as with the master shards in host memory)
            sb = ps["buffers"]
            host_ids = {u["buffer"] for u in ps["units"] if u.get("offloaded")}
            root = lambda b: sb[b].get("alias_of", b)
            want = sum(1 for x in ps["program"]
                       if x["op"] == "to_device" and root(x["in"][0]) in host_ids)
            report(s.get("nvme_read_bytes_per_step") == rd and
                   s.get("nvme_written_bytes_per_step") == wr and s.get("nvme_bytes") ==
                   pb["nvme_bytes"] and copies and reads_copy and
                   len(copies) == want,
                   f"(c) {what}: {rd} B read and {wr} B written a step, {len(copies)} copies to "
                   f"the device each reading its blocks from the swap file")

        # (d) the reads ahead
        model, n, pipeline = CONFIGS[1]
        ref = None
        for ahead in (0, 1, 2):
            plan = compile_(model, n, pipeline, True, f"ahead{ahead}",
                            f"offload-nvme-read-ahead={ahead}")
            p = json.load(open(plan))
            order = [i for i, x in swapping(p)
                     if x["op"] == "to_device" or x.get("attrs", {}).get("async")]
            want = {k: (order[j - ahead] if j >= ahead else 0)
                    for j, k in enumerate(order) if ahead and (j >= ahead or k != 0)}
            at = {i: x["attrs"]["swap_read_at"] for i, x in swapping(p)
                  if "swap_read_at" in x["attrs"]}
            got, s = train(plan, n, "--steps", "4")
            ref = ref if ref is not None else got
            report(at == want and got == ref and len(order) > 4 and
                   s["measured_host_high_water"] == s["predicted_host_peak"],
                   f"(d) read-ahead {ahead}: {len(at)} of {len(order)} swapping instructions "
                   f"read ahead where expected, bitwise the same losses, host arena "
                   f"{p['host_arena_bytes']} B measured == predicted")

        # (e) checkpoints across the two placements
        model, n, pipeline = CONFIGS[6]  # next-step: the updates of step 3 run in step 4
        state = os.path.join(tmp, "c6-state.plan")
        both = os.path.join(tmp, "c6-both.plan")
        ref, _ = train(both, n, "--steps", "6", "--save", os.path.join(tmp, "e-ref.st"))
        ck = os.path.join(tmp, "ck")
        first, _ = train(both, n, "--steps", "3", "--ckpt-dir", ck)
        for tag, plan in (("parameters on disk", both), ("parameters in host memory", state)):
            rest, _ = train(plan, n, "--steps", "6", "--resume", ck, "--save",
                            os.path.join(tmp, f"e-{len(tag)}.st"))
            report(first + rest == ref and read(os.path.join(tmp, f"e-{len(tag)}.st")) ==
                   read(os.path.join(tmp, "e-ref.st")),
                   f"(e) {model} N={n}: a checkpoint of step 3 with the parameters on disk "
                   f"resumes with the {tag} bitwise to step 6")
        ck2 = os.path.join(tmp, "ck2")
        first, _ = train(state, n, "--steps", "3", "--ckpt-dir", ck2)
        rest, _ = train(both, n, "--steps", "6", "--resume", ck2)
        report(first + rest == ref,
               f"(e) {model} N={n}: a checkpoint with the parameters in host memory resumes "
               f"with them on disk bitwise")
        final = os.path.join(tmp, "e-ref.st")
        a, _ = train(both, n, "--steps", "1", "--init-from", final)
        b, _ = train(state, n, "--steps", "1", "--init-from", final)
        report(a == b and len(a) == 1,
               f"(e) {model} N={n}: --init-from writes the parameters into the swap file "
               f"(first loss {a[0] if a else None} in both placements)")

        # (f) refusals
        def said(r):
            return next((l.strip() for l in r.stderr.splitlines() if "nvme-params" in l), "")[:140]

        r = fsdp_opt("mlp", 1, "optimizer=adamw stage=3 offload=optimizer offload-nvme-params=true")
        report(r.returncode != 0 and "nvme-params" in r.stderr and "offload-nvme=true" in r.stderr,
               "(f) offload-nvme-params without offload-nvme is refused: " + said(r))
        r = fsdp_opt("mlp", 1, "optimizer=adamw stage=3 offload=auto memory-budget=64MiB "
                     "offload-nvme-params=true")
        report(r.returncode != 0 and "offload-nvme-params" in r.stderr,
               "(f) and by the memory-budget search: " + said(r))
        r = subprocess.run([os.path.join(bindir, "fsdp-run"), os.path.join(tmp, "c0-both.plan"),
                            "--steps", "1"], capture_output=True, text=True, timeout=120)
        report(r.returncode == 1 and "optimizer state and parameters in a swap file" in r.stderr
               and "--nvme-dir" in r.stderr,
               "(f) such a plan without --nvme-dir is refused: " + r.stderr.strip()[-110:])

        # (g) the cost model
        sim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools",
                           "fsdp-sim", "fsdp-sim")
        steps = {}
        for tag, (model, n, pipeline), extra in (
                ("R=0", CONFIGS[1], "offload-nvme-read-ahead=0"),
                ("R=1", CONFIGS[1], ""), ("R=2", CONFIGS[1], "offload-nvme-read-ahead=2"),
                ("sync copies", CONFIGS[3], "")):
            plan = compile_(model, n, pipeline, True, "g" + tag.replace(" ", "").replace("=", ""),
                            extra)
            p = json.load(open(plan))
            out = subprocess.run([sys.executable, sim, plan, "--json", "--trace", plan + ".trace"],
                                 check=True, capture_output=True, text=True).stdout
            sd = [json.loads(l) for l in out.splitlines() if l.startswith("{")][0]
            steps[tag] = sd["step_ms"]
            io_ms = 1e3 * sum(p["buffers"][sw[1]]["bytes"] / 6.5e9 +
                              (p["buffers"][sw[0]]["bytes"] / 3.5e9 if sw[2] else 0.0)
                              for _, x in swapping(p) for sw in x["attrs"]["swap"]
                              if x["op"] == "to_device" or x["attrs"].get("async"))
            r = fsdp_opt(model, n, f"{pipeline} offload=optimizer offload-nvme=true "
                         f"offload-nvme-params=true {extra} simulate=true")
            m = re.search(r"step\s+([0-9.]+) ms", r.stderr)
            h = re.search(r"host updates\s+([0-9.]+) ms", r.stderr)
            w = re.search(r"swaps \(drive busy\)\s+([0-9.]+) ms", r.stderr)
            # (no host stream line where every update is joined at once)
            agree = (m is not None and w is not None and
                     abs(float(m.group(1)) - sd["step_ms"]) <= 6e-4 and
                     abs((float(h.group(1)) if h else 0.0) - sd["host_ms"]) <= 6e-4 and
                     abs(float(w.group(1)) - sd["swap_ms"]) <= 6e-4)
            spans = {}
            for e in json.load(open(plan + ".trace"))["traceEvents"]:
                # (the copy's own span: compute's stall before it is a "wait")
                if e.get("ph") == "X" and (e["tid"] == 4 or e["tid"] in (0, 3) and
                                           e["name"] == "to_device"):
                    spans.setdefault((e["args"]["instruction"], e["tid"]), []).append(
                        (e["ts"], e["ts"] + e["dur"]))
            copies = [j for j, x in swapping(p) if x["op"] == "to_device"]
            async_ = any(x["attrs"].get("async") for j, x in swapping(p) if j in copies)
            ordered = [j for j in copies if (j, 4) in spans and (j, 3 if async_ else 0) in spans
                       and max(e for _, e in spans[(j, 4)]) <=
                       min(s for s, _ in spans[(j, 3 if async_ else 0)]) + 1e-6]
            report(agree and abs(sd["swap_ms"] - io_ms) <= 1e-9 + 1e-9 * io_ms and copies and
                   ordered == copies,
                   f"(g) {tag}: fsdp-opt simulate=true agrees with fsdp-sim (step "
                   f"{sd['step_ms']:.4f} ms, host {sd['host_ms']:.4f}, drive {sd['swap_ms']:.4f} "
                   f"ms = the stagings read and the shards written back at 6.5 / 3.5 GB/s), "
                   f"each of {len(copies)} {'async' if async_ else 'sync'} copies' blocks read "
                   f"before it starts")
        for tag, i in (("async copies", 1), ("sync copies", 3)):
            model, n, pipeline = CONFIGS[i]
            plan = os.path.join(tmp, f"c{i}-both.plan")
            trace = os.path.join(tmp, f"run-trace{i}.json")
            train(plan, n, "--steps", "4", "--trace", trace)
            p = json.load(open(trace))
            spans = {}  # (rank, step, instruction) -> {track: (start, end)}
            for e in p["traceEvents"]:
                if e.get("ph") == "X" and e["tid"] in (0, 2, 4):
                    key = (e["pid"], e["args"]["step"], e["args"]["instruction"])
                    spans.setdefault(key, {})[e["tid"]] = (e["ts"], e["ts"] + e["dur"])
            pb = json.load(open(plan))
            copies = [j for j, x in swapping(pb) if x["op"] == "to_device"]
            updates = [j for j, x in swapping(pb) if x["op"] != "to_device" and
                       x["attrs"].get("async")]
            keys = [(r, st, j) for r in range(n) for st in range(1, 5) for j in copies + updates]
            bad = [k for k in keys if not (
                {4, 0 if k[2] in copies else 2} <= spans.get(k, {}).keys() and
                (spans[k][4][1] <= spans[k][0][1] if k[2] in copies
                 else spans[k][4][1] <= spans[k][2][0]))]
            report(not bad and copies,
                   f"(g) fsdp-run --trace, {tag} (N={n}): each of {len(keys)} copies and updates "
                   f"(ranks x steps x instructions) read on the swap-in thread before it copied "
                   f"or ran ({len(bad)} out of order: {bad[:3]})")
        report(steps["R=2"] <= steps["R=1"] < steps["R=0"],
               f"(g) reading ahead predicts shorter steps: R=0 {steps['R=0']:.4f} ms, R=1 "
               f"{steps['R=1']:.4f}, R=2 {steps['R=2']:.4f}")

        # (h) the search
        lean = "offload-nvme-in-flight=1 offload-nvme-read-ahead=0"
        arenas = {}
        for params in (False, True):
            plan = compile_("mlp", 1, CONFIGS[0][2], params, f"lean{params}", lean)
            arenas[params] = json.load(open(plan))["host_arena_bytes"]
        ref, _ = train(os.path.join(tmp, "c0-state.plan"), 1, "--steps", "6")
        for budget, want in (((arenas[True] + arenas[False]) // 2, True),
                             (arenas[False] + 4096, False)):
            plan = os.path.join(tmp, f"h{budget}.plan")
            r = fsdp_opt("mlp", 1, "optimizer=adamw memory-budget=64MiB offload=optimizer "
                         f"offload-nvme=true offload-nvme-params=auto host-memory-budget={budget}",
                         plan)
            if r.returncode != 0:
                report(False, f"(h) host budget {budget} B: the search failed: {said(r)}")
                continue
            p = json.load(open(plan))
            st = p["strategy"]
            got, s = train(plan, 1, "--steps", "6")
            report(st["offload_nvme_params"] == want and p["host_arena_bytes"] <= budget and
                   s["measured_host_high_water"] == p["host_arena_bytes"] and got == ref,
                   f"(h) host budget {budget} B (the leanest host arenas: {arenas[True]} B with "
                   f"the shards on disk, {arenas[False]} B without): the search keeps them "
                   f"{'on disk' if st['offload_nvme_params'] else 'in host memory'} "
                   f"({p['host_arena_bytes']} B, {st['offload_nvme_in_flight']} in flight, read "
                   f"ahead {st['offload_nvme_read_ahead']}), training bitwise as the state-on-disk "
                   f"plan")
        r = fsdp_opt("mlp", 1, "optimizer=adamw memory-budget=64MiB offload=optimizer "
                     f"offload-nvme=true offload-nvme-params=auto host-memory-budget="
                     f"{arenas[True] // 2}")
        m = re.search(r"smallest host arena reachable is [^(]*\((\d+) bytes\)", r.stderr)
        report(r.returncode != 0 and m is not None and int(m.group(1)) <= arenas[True],
               f"(h) host budget {arenas[True] // 2} B: refused, the floor named "
               f"({m.group(1) if m else '?'} B) no higher than the shards on disk's "
               f"{arenas[True]} B")

    return report.finish("all nvme-params checks passed")


if __name__ == "__main__":
    sys.exit(main())
