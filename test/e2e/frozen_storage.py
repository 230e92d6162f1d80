#!/usr/bin/env python3
"""Frozen units stored in the compute dtype (frozen-storage=compute).

usage: frozen_storage.py BIN_DIR

A GPT with its first two of three blocks frozen (gen_models.py
--frozen-layers 2), bf16 or f16 compute. With frozen-storage=compute a
frozen unit read only in the compute dtype stores it: each value is
rounded to nearest once, when stored, instead of by the cast before each
read, so compute sees the same bits. Against frozen-storage=declared (f32
storage, the default):
(a) at stages 1, 2 and 3 (N=2), with offload=all (the host arena) and in
    f16 with loss scaling: the losses of 6 steps are bitwise equal, each
    frozen unit stores the compute dtype (half the bytes: the plan's
    parameter storage shrinks by exactly that), and fsdp-run measures both
    arenas equal to the plan;
(b) --save writes each frozen parameter as its f32 value rounded to bf16
    (round to nearest even, computed here from the declared plan's file)
    and every trainable parameter bitwise as the declared plan;
(c) checkpoints: 4 steps, --resume to 8 gives the uninterrupted losses and
    parameters bitwise; fsdp-ckpt reshard of the declared plan's
    checkpoint onto the compute plan (the frozen values rounded) resumes
    with the declared plan's uninterrupted losses bitwise; resharded from
    2 ranks to 1 it keeps every parameter (fsdp-ckpt export);
(d) --init-from the declared plan's saved parameters gives both plans the
    same losses, bitwise (the compute plan rounds the frozen values as it
    loads them);
(e) frozen-storage=compute with f32 compute changes nothing (the plan is
    byte for byte the declared one), and a misspelt value is refused by
    name.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")

CONFIGS = [
    (2, "optimizer=adamw stage=3 param-dtype=bf16"),
    (2, "optimizer=adamw stage=2 param-dtype=bf16 max-grad-norm=1.0"),
    (2, "optimizer=sgd momentum=0.9 stage=1 param-dtype=bf16"),
    (2, "optimizer=adamw stage=3 param-dtype=bf16 offload=all"),
    (2, "optimizer=adamw stage=3 param-dtype=f16"),
]
HALF = {"bf16", "f16"}


def read_safetensors(path):
    """name -> (dtype, raw bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    return {k: (v["dtype"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def round_bf16(raw):
    """f32 bytes rounded to bf16 (nearest even) and widened back."""
    out = bytearray()
    for (u,) in struct.iter_unpack("<I", raw):
        if (u & 0x7fffffff) > 0x7f800000:
            r = (u | 0x00400000) & 0xffff0000
        else:
            r = ((u + 0x7fff + ((u >> 16) & 1)) >> 16) << 16
        out += struct.pack("<I", r & 0xffffffff)
    return bytes(out)


def main():
    bindir = sys.argv[1]
    failures = []

    def report(ok, what):
        print(f"{what}  {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "gpt.mlir")
        subprocess.run([sys.executable, GEN, "gpt", "--vocab", "64", "--ctx", "8", "--layers", "3",
                        "--heads", "2", "--width", "16", "--batch", "4", "--frozen-layers", "2",
                        "-o", model], check=True)

        def compile_(tag, n, pipeline, check=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
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
            return ([r["loss"] for r in rows if "step" in r and "loss" in r],
                    [r for r in rows if r.get("summary")][0])

        def storage(plan):
            p = json.load(open(plan))
            return p, {u["name"]: p["buffers"][u["buffer"]] for u in p["units"]}

        for i, (n, pipeline) in enumerate(CONFIGS):
            what = f"N={n} {pipeline}"
            dec = compile_(f"c{i}-dec", n, pipeline)
            com = compile_(f"c{i}-com", n, pipeline + " frozen-storage=compute")
            ref, _ = train(dec, n, "--steps", "6", "--save", dec + ".st")
            got, s = train(com, n, "--steps", "6", "--save", com + ".st")
            pd, sd = storage(dec)
            pc, sc = storage(com)
            half = pipeline.split("param-dtype=")[1].split()[0]
            frozen = [u["name"] for u in pc["units"] if u.get("frozen")]
            saved = sum(sd[f]["bytes"] - sc[f]["bytes"] for f in frozen)
            where = "host" if "offload=all" in pipeline else "device"
            before = (pd["memory"]["host"]["params"] if where == "host"
                      else pd["memory"]["params"])
            after = (pc["memory"]["host"]["params"] if where == "host"
                     else pc["memory"]["params"])
            ok = (len(got) == 6 and got == ref and len(frozen) == 2 and
                  all(sc[f]["dtype"] == half and sd[f]["dtype"] == "f32" and
                      2 * sc[f]["bytes"] == sd[f]["bytes"] for f in frozen) and
                  all(sc[u]["dtype"] == "f32" for u in sc if u not in frozen) and
                  before - after == saved > 0 and
                  s["measured_high_water"] == s["predicted_peak"] and
                  s["measured_peak_live"] == s["predicted_peak_live"] and
                  s.get("measured_host_high_water") == s.get("predicted_host_peak"))
            report(ok, f"(a) {what}: losses bitwise equal, the frozen units stored {half} "
                       f"({where} parameter storage {before} -> {after} B), measured == "
                       "predicted")
            if i == 0:
                # (b) --save: frozen values rounded, trainable ones equal.
                a, b = read_safetensors(dec + ".st"), read_safetensors(com + ".st")
                frozen_params = [k for k in a if k.startswith("transformer.h.0.") or
                                 k.startswith("transformer.h.1.")]
                rounded = all(b[k][0] == "F32" and b[k][1] == round_bf16(a[k][1])
                              for k in frozen_params)
                moved = any(b[k][1] != a[k][1] for k in frozen_params)
                same = all(b[k] == a[k] for k in a if k not in frozen_params)
                report(sorted(a) == sorted(b) and frozen_params and rounded and moved and same,
                       f"(b) --save: {len(frozen_params)} frozen parameters are the declared "
                       f"ones rounded to bf16, the other {len(a) - len(frozen_params)} bitwise "
                       "equal")

        # (c) checkpoints, on the stage-3 bf16 plans.
        n, pipeline = CONFIGS[0]
        dec, com = (os.path.join(tmp, f"c0-{t}.plan") for t in ("dec", "com"))
        ref, _ = train(com, n, "--steps", "8", "--save", com + ".ref.st")
        ck = os.path.join(tmp, "ck-com")
        train(com, n, "--steps", "4", "--ckpt-dir", ck, "--save-every", "2")
        after, _ = train(com, n, "--steps", "8", "--resume", ck, "--save", com + ".res.st")
        report(after == ref[4:] and
               open(com + ".ref.st", "rb").read() == open(com + ".res.st", "rb").read(),
               "(c) resumed at step 4: steps 5-8 and the final parameters bitwise")
        ckpt = os.path.join(bindir, "fsdp-ckpt")
        dck, conv = os.path.join(tmp, "ck-dec"), os.path.join(tmp, "ck-conv")
        train(dec, n, "--steps", "4", "--ckpt-dir", dck, "--save-every", "4")
        subprocess.run([ckpt, "reshard", dck, "--plan", com, conv], check=True,
                       capture_output=True)
        conv_after, _ = train(com, n, "--steps", "8", "--resume", conv)
        dec_ref, _ = train(dec, n, "--steps", "8")
        report(conv_after == dec_ref[4:] and len(conv_after) == 4,
               "(c) the declared plan's checkpoint resharded onto the compute plan resumes "
               "with the declared plan's losses 5-8, bitwise")
        one = compile_("c0-com-n1", 1, pipeline + " frozen-storage=compute")
        out1 = os.path.join(tmp, "ck-n1")
        subprocess.run([ckpt, "reshard", ck, "--plan", one, out1], check=True,
                       capture_output=True)
        ea, eb = os.path.join(tmp, "ea.st"), os.path.join(tmp, "eb.st")
        subprocess.run([ckpt, "export", ck, ea], check=True, capture_output=True)
        subprocess.run([ckpt, "export", out1, eb], check=True, capture_output=True)
        resumed1, _ = train(one, 1, "--steps", "6", "--resume", out1)
        report(read_safetensors(ea) == read_safetensors(eb) and len(resumed1) == 2,
               "(c) resharded 2 ranks -> 1 (16-bit frozen storage): every parameter kept, "
               "resumes")

        # (d) --init-from the declared plan's saved parameters.
        init = dec + ".st"
        la, _ = train(dec, n, "--steps", "4", "--init-from", init)
        lb, _ = train(com, n, "--steps", "4", "--init-from", init)
        report(len(la) == 4 and la == lb,
               "(d) --init-from the declared plan's parameters: the same losses, bitwise")

        # (e) f32 compute, and a misspelt value.
        f1 = compile_("f32-dec", 2, "optimizer=adamw stage=3")
        f2 = compile_("f32-com", 2, "optimizer=adamw stage=3 frozen-storage=compute")
        err = compile_("bogus", 2, "optimizer=adamw stage=3 frozen-storage=bf16", check=False)
        report(open(f1, "rb").read() == open(f2, "rb").read() and
               "frozen-storage='bf16' must be declared or compute" in err,
               "(e) f32 compute: the same plan; frozen-storage=bf16 refused by name")

    if failures:
        print("FAILED:", "; ".join(failures))
        return 1
    print("all frozen-storage checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
