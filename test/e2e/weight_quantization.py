#!/usr/bin/env python3
"""ZeRO++'s quantized weight all-gather (fsdp-shard weight-quantization=int8)
end to end on CPU ranks.

usage: weight_quantization.py BIN_DIR

The MLP of the FSDP2 tutorial (hidden 64, 4 blocks), ZeRO-3 on 2 ranks,
f32 and bf16 compute, against the same plan without quantization:
- every parameter all-gather of the plan moves int8 bytes: per rank
  quantizedBytes(S) = S padded to 4 + 4 ceil(S / block) for a shard of S
  values (ShapeRules.h), and the bytes each rank sends a step (fsdp-run's
  comm_bytes_per_step, the ring volume of the plan's collectives) equal
  that arithmetic over the plan's collectives, for both plans: the
  quantized plan's gathers move (S + 4 S / block) / (4 S) of the f32
  plan's (a bf16 plan's: / (2 S));
- the arenas' high-water and peak live bytes are the plan's prediction;
- step 1 computes with the dequantized initial parameters: its loss
  differs from the unquantized plan's (the quantization is applied), and
  the run is deterministic (two runs bitwise equal);
- it trains: the mean of the last 10 of 60 losses is below the first 10's,
  as for the unquantized run;
- over Gloo (--comm gloo) the losses are bitwise those over shared memory
  (an all-gather moves bytes; no arithmetic depends on the transport).
The kernels' arithmetic against runtime/core/Quantize.h (bitwise) and the
dequantized values' error bound are DeviceConformance.QuantizedGathers-
MatchTheReference, on the CPU device and the CUDA emulator.
"""
import json
import os
import sys
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e_lib import (Checks, gen_models, run_json, arenas_measured_as_planned,  # noqa: E402
                     quantized_bytes, ring_bytes)

BLOCK = 64
STEPS = 60


def compile_plan(bindir, model, path, opts):
    subprocess.run([os.path.join(bindir, "fsdp-opt"), model,
                    f"--fsdp-pipeline=optimizer=adamw world-size=2 stage=3 {opts} "
                    f"plan={path} report=false", "-o", os.devnull], check=True)
    with open(path) as f:
        return json.load(f)


def gathers(plan):
    return [i for i in plan["program"] if i["op"] == "all_gather"]


def main():
    bindir = sys.argv[1]
    check = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        model = gen_models(tmp, {"mlp": ["mlp", "--hidden", "64", "--blocks", "4",
                                         "--batch", "32"]})["mlp"]
        for dtype in ("f32", "bf16"):
            mp = "" if dtype == "f32" else "param-dtype=bf16"
            ref = compile_plan(bindir, model, os.path.join(tmp, f"{dtype}.plan"), mp)
            qpath = os.path.join(tmp, f"{dtype}-q.plan")
            q = compile_plan(bindir, model, qpath,
                             f"{mp} weight-quantization=int8 quantization-block={BLOCK}")
            bufs, rbufs = q["buffers"], ref["buffers"]
            qg, rg = gathers(q), gathers(ref)
            esize = 4 if dtype == "f32" else 2
            ok = len(qg) == len(rg) > 0
            for a, b in zip(qg, rg):
                shard = rbufs[b["in"][0]]["bytes"] // esize
                ok &= (bufs[a["in"][0]]["dtype"] == "i8" and
                       bufs[a["in"][0]]["bytes"] == quantized_bytes(shard, BLOCK) and
                       bufs[a["out"][0]]["bytes"] == 2 * quantized_bytes(shard, BLOCK))
            check(ok, f"{dtype}: {len(qg)} all-gathers move int8 shards of "
                      f"S + pad + 4 ceil(S/{BLOCK}) bytes")
            ops = [i["op"] for i in q["program"]]
            check(ops.count("quantize") == ops.count("dequantize") == len(qg),
                  f"{dtype}: a quantize and a dequantize per all-gather")

            rl, rs = run_json(bindir, os.path.join(tmp, f"{dtype}.plan"), 2, "--steps",
                              str(STEPS))
            ql, qs = run_json(bindir, qpath, 2, "--steps", str(STEPS))
            ql2, _ = run_json(bindir, qpath, 2, "--steps", str(STEPS))
            gl, gs = run_json(bindir, qpath, 2, "--steps", str(STEPS), "--comm", "gloo")
            for name, p, s in (("unquantized", ref, rs), ("quantized", q, qs),
                               ("quantized over gloo", q, gs)):
                check(s["comm_bytes_per_step"] == ring_bytes(p),
                      f"{dtype} {name}: {s['comm_bytes_per_step']} bytes sent a step, "
                      f"{ring_bytes(p)} by the plan's arithmetic")
            check(arenas_measured_as_planned(qs, q), f"{dtype}: arenas measured as planned")
            gathered = sum(2 * quantized_bytes(rbufs[b["in"][0]]["bytes"] // esize, BLOCK)
                           for b in rg) / sum(rbufs[b["out"][0]]["bytes"] for b in rg)
            print(f"measured: {dtype} all-gather bytes {gathered:.3f}x, a step's bytes sent "
                  f"{qs['comm_bytes_per_step']} vs {rs['comm_bytes_per_step']} "
                  f"({qs['comm_bytes_per_step'] / rs['comm_bytes_per_step']:.3f}x); "
                  f"step-1 loss {ql[0]:.7f} vs {rl[0]:.7f}, last-10 mean "
                  f"{sum(ql[-10:]) / 10:.5f} vs {sum(rl[-10:]) / 10:.5f}")
            check(ql[0] != rl[0], f"{dtype}: step 1 computes with the quantized parameters "
                                  f"({ql[0]!r} vs {rl[0]!r})")
            check(ql == ql2, f"{dtype}: two runs bitwise equal")
            check(ql == gl, f"{dtype}: gloo bitwise shared memory")
            check(sum(ql[-10:]) < sum(ql[:10]) and sum(rl[-10:]) < sum(rl[:10]),
                  f"{dtype}: both learn")
    return check.finish("weight quantization checks pass")


if __name__ == "__main__":
    sys.exit(main())
