#!/usr/bin/env python3
"""Activation offload (offload-activations=true, fsdp-offload-activations):
same training, the saved activations in host memory between the passes.

usage: offload_activations.py BIN_DIR

The pass only adds exact copies (to_host after a saved activation's
definition, to_device before its first backward read), so for every
configuration below, against the same plan without it:
(a) the losses of 6 steps and the final parameters are bitwise equal (a
    run with a 1e-6 relative change of the learning rate is not);
(b) memory: the host arena holds the copies (memory.host.activations > 0)
    and no parameter or state; the device peak live is never higher, and
    lower where the saved activations are at the peak (no recomputation:
    the start of the backward pass); fsdp-run measures both arenas'
    high-water and peak live bytes equal to the plan's;
(c) the loss's input (the logits, read by the backward pass at once) is
    never copied; the host copies are read only by the copies back and the waits (the
    device never reads host memory); with overlap (the default) every copy
    is async and has exactly one wait, with overlap=false none is; no copy
    is left in the forward slice's evaluation (validation losses bitwise).
Each configuration is compiled with overlap (async copies on the
communication stream) and with overlap=false (in-order copies), each
against the plan without activation offload compiled the same way.
"""
import json
import os
import subprocess
import sys
import tempfile

from e2e_lib import Checks, arenas_as_planned

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")

# (model, ranks, pipeline options, device peak must drop); each is also
# compiled with overlap=false.
CONFIGS = [
    ("mlp", 1, "optimizer=adamw", True),
    ("gpt", 1, "optimizer=adamw max-grad-norm=1.0", True),
    ("gpt", 2, "optimizer=adamw stage=3 recompute=unit", False),
    ("gpt", 2, "optimizer=adamw stage=3 recompute=selective weight-decay-params=matrices",
     False),
    ("gpt", 3, "optimizer=adamw stage=2 grad-accum=2", False),
    ("llama", 2, "optimizer=adamw stage=3 param-dtype=bf16", False),
    ("gpt", 2, "optimizer=adamw stage=3 offload=optimizer", False),
    ("gpt", 2, "optimizer=sgd momentum=0.9 stage=3 reshard-after-forward=false", True),
]


def main():
    bindir = sys.argv[1]
    report = Checks()

    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name, args in (
                ("mlp", ["mlp", "--hidden", "64", "--blocks", "4", "--batch", "64"]),
                ("gpt", ["gpt", "--vocab", "64", "--ctx", "16", "--layers", "2",
                         "--heads", "2", "--width", "32", "--batch", "4"]),
                ("llama", ["llama", "--vocab", "64", "--ctx", "16", "--layers", "2",
                           "--heads", "4", "--kv-heads", "2", "--width", "32", "--ffn", "64",
                           "--batch", "4"])):
            models[name] = os.path.join(tmp, name + ".mlir")
            subprocess.run([sys.executable, GEN] + args + ["-o", models[name]], check=True)

        def compile_(model, n, pipeline, oa, tag):
            plan = os.path.join(tmp, tag + ".plan")
            subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o", os.devnull,
                            f"--fsdp-pipeline=world-size={n} {pipeline} "
                            f"offload-activations={oa} plan={plan} report=false"],
                           capture_output=True, text=True, check=True)
            return plan

        def train(plan, n, *extra):
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json",
                                  "--threads", "1", "--lr", "1e-2"] + list(extra)
                                 + (["--nproc", str(n)] if n > 1 else []),
                                 check=True, capture_output=True, text=True, timeout=300).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            losses = [r["loss"] for r in rows if "step" in r and "loss" in r]
            summary = [r for r in rows if r.get("summary")][0]
            vals = [r["val_loss"] for r in rows if r.get("eval")]
            return losses, summary, vals

        def read(path):
            with open(path, "rb") as f:
                return f.read()

        runs = [(i, c, ov) for i, c in enumerate(CONFIGS) for ov in ("true", "false")]
        for i, (model, n, pipeline, drops), ov in runs:
            pipeline = f"{pipeline} overlap={ov}"
            what = f"{model} N={n} {pipeline}"
            base = compile_(model, n, pipeline, "false", f"c{i}-{ov}-none")
            off = compile_(model, n, pipeline, "true", f"c{i}-{ov}-oa")
            ref, _, _ = train(base, n, "--steps", "6", "--save", base + ".st")
            got, s, _ = train(off, n, "--steps", "6", "--save", off + ".st")
            # (a)
            report(got == ref and len(got) == 6, f"(a) {what}: losses bitwise equal")
            if i == 0 and ov == "true":
                moved, _, _ = train(off, n, "--steps", "6", "--lr", repr(1e-2 * (1 + 1e-6)))
                report(moved != ref, f"(a) {what}: lr * (1 + 1e-6) is caught")
            report(read(base + ".st") == read(off + ".st"),
                   f"(a) {what}: final parameters bitwise equal")
            # (b)
            pb, po = json.load(open(base)), json.load(open(off))
            mb, mo = pb["memory"], po["memory"]
            hb, ho = mb.get("host", {}), mo.get("host", {})
            offloaded_opt = "offload=optimizer" in pipeline
            host_ok = (ho.get("activations", 0) > 0 and
                       ho.get("params", 0) == hb.get("params", 0) and
                       ho.get("state", 0) == hb.get("state", 0) and
                       (offloaded_opt or (ho["params"] == 0 and ho["state"] == 0)))
            report(host_ok, f"(b) {what}: host holds {ho.get('activations')} B of activations")
            lower = mo["peak_live"] < mb["peak_live"] if drops else \
                mo["peak_live"] <= mb["peak_live"]
            report(lower, f"(b) {what}: device peak live {mo['peak_live']} "
                          f"{'<' if drops else '<='} {mb['peak_live']} B")
            measured = arenas_as_planned(s, po)
            report(measured, f"(b) {what}: measured == predicted, device "
                             f"{s['measured_high_water']} B and host "
                             f"{s['measured_host_high_water']} B")
            # (c) the copies pair up: host copies are read only by to_device.
            bufs = po["buffers"]
            host_ids = {b["id"] for b in bufs
                        if b.get("space") == "host" and b.get("kind") == "activation"}
            prog = po["program"]
            made = {ins["out"][0] for ins in prog if ins["op"] == "to_host"}
            readers_ok = all(
                ins["op"] in ("to_device", "wait") or not (set(ins["in"]) & (made & host_ids))
                for ins in prog)
            act = made & host_ids  # the activations' host copies
            copies = [ins for ins in prog
                      if (ins["op"] == "to_host" and ins["out"][0] in act) or
                      (ins["op"] == "to_device" and ins["in"][0] in act)]
            waits = [ins["in"][0] for ins in prog if ins["op"] == "wait"]
            want_async = ov == "true"
            paired = all(bool(c["attrs"].get("async")) == want_async and
                         waits.count(c["out"][0]) == (1 if want_async else 0)
                         for c in copies)
            # The loss's input (the logits) is read by the backward pass at
            # once: never copied, also with accumulation (whose loss sum
            # follows the last micro-batch's loss).
            def root(i):
                while bufs[i].get("alias_of", -1) >= 0:
                    i = bufs[i]["alias_of"]
                return i
            logits = {root(ins["in"][0]) for ins in prog
                      if ins["op"] in ("cross_entropy", "cross_entropy_fused", "mse_loss",
                                       "bce_with_logits")}
            copied = {root(ins["in"][0]) for ins in prog if ins["op"] == "to_host"}
            report(logits and not (logits & copied),
                   f"(c) {what}: the loss's input is not copied")
            report(readers_ok and paired and copies,
                   f"(c) {what}: {len(copies)} copies, "
                   f"{'each async with one wait' if want_async else 'in order'}, host "
                   f"copies read only by copies and waits")

        # (c) evaluation: the loss's slice has no copy; validation bitwise.
        vals = {}
        for oa in ("false", "true"):
            plan = compile_("gpt", 2, "optimizer=adamw stage=3 recompute=unit", oa, f"ev-{oa}")
            _, _, vals[oa] = train(plan, 2, "--steps", "4", "--eval-every", "2")
        report(len(vals["false"]) == 3 and vals["false"] == vals["true"],
               f"(c) gpt N=2: validation losses bitwise equal ({len(vals['false'])} "
               f"evaluations)")

    return report.finish("all activation offload checks passed")


if __name__ == "__main__":
    sys.exit(main())
