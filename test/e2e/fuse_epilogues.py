#!/usr/bin/env python3
"""Fused matmul epilogues change the kernels' count, never results.

For every N in the list and a few configurations (stage 0, stage 3, stage
3 with selective and with per-unit recomputation, stage 3 with gradient
accumulation),
compiles the model with fuse-epilogues=true and =false, runs both for S
steps on N ranks and checks that
  - the per-step losses and the final parameters are bitwise equal (the
    CPU kernels of matmul_bias, matmul_gelu_grad, matmul_bias_grad,
    residual_layer_norm, layer_norm_grad_acc, attention_qkv(_grad),
    cross_entropy_fused, swiglu(_grad), residual_rms_norm and
    rms_norm_grad_acc run the unfused ops' kernels (or
    their arithmetic, one definition) in the same order,
    and an update with grad_scale multiplies its gradient first, as the
    clipping mul did);
  - the fused plan has fused ops, every optimizer update reads the
    clipping factor as its grad_scale (no mul), fewer instructions, and plans a peak
    no larger than the unfused one;
  - fsdp-run measures exactly the predicted arena high-water and peak
    live bytes for both plans.
A control run with the learning rate perturbed by 1e-6 (relative) must be
reported as different (if it is not, the script fails).

usage: fuse_epilogues.py BIN_DIR mlp|gpt|llama OPTIMIZER STEPS N [N ...]
"""
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from recompute import GLOBAL_BATCH, compile_plan, control, differs, run  # noqa: E402
from shard_equivalence import gen  # noqa: E402

FUSED = ("matmul_bias", "matmul_gelu_grad", "matmul_bias_grad", "residual_layer_norm",
         "layer_norm_grad_acc", "attention_qkv", "attention_qkv_grad", "cross_entropy_fused",
         "swiglu", "swiglu_grad", "residual_rms_norm", "rms_norm_grad_acc")


def main():
    bindir, kind, optimizer = sys.argv[1], sys.argv[2], sys.argv[3]
    steps = int(sys.argv[4])
    worlds = [int(a) for a in sys.argv[5:]]
    failures = 0
    control_done = False
    print(f"{kind} ({optimizer}): fuse-epilogues=true against false, {steps} steps, bitwise")
    with tempfile.TemporaryDirectory() as tmp:
        configs = ["stage=0", "stage=3", "stage=3 recompute=selective",
                   "stage=3 recompute=unit", "stage=3 grad-accum=2 accum-reduce=microbatch"]
        for n in worlds:
            for config in configs:
                accum = 2 if "grad-accum=2" in config else 1
                model = os.path.join(tmp, f"b{n}x{accum}.mlir")
                if not os.path.exists(model):
                    gen(kind, GLOBAL_BATCH[kind] // n // accum, model)
                base = f"optimizer={optimizer} max-grad-norm=1.0 world-size={n} {config}"
                results, plans, measured_ok = {}, {}, True
                for fuse in ("false", "true"):
                    tag = os.path.join(tmp, f"n{n}-{config.replace(' ', '_')}-{fuse}")
                    plans[fuse] = compile_plan(bindir, model, tag + ".plan",
                                               f"{base} fuse-epilogues={fuse}")
                    losses, params, ok = run(bindir, tag + ".plan", tag + ".st", n, steps)
                    results[fuse] = (losses, params)
                    measured_ok &= ok
                if not control_done:
                    failures += not control(bindir, os.path.join(
                        tmp, f"n{n}-{config.replace(' ', '_')}-false.plan"), results["false"],
                        n, steps, tmp)
                    control_done = True
                bad = differs(results["false"], results["true"])
                ops = lambda p: [i["op"] for i in p["program"]]
                fused = sum(op in FUSED for op in ops(plans["true"]))
                unfused_left = sum(op in FUSED for op in ops(plans["false"]))
                fewer = len(ops(plans["true"])) < len(ops(plans["false"]))
                # The clipping factor folded into every update (grad_scale).
                scaled = lambda p: sum(1 for i in p["program"] if i["op"].endswith("_update")
                                       and i["attrs"].get("grad_scale") is True)
                updates = sum(1 for i in plans["true"]["program"] if i["op"].endswith("_update"))
                folded = scaled(plans["true"]) == updates > 0 and scaled(plans["false"]) == 0
                peak_t, peak_f = plans["true"]["memory"]["peak"], plans["false"]["memory"]["peak"]
                ok = (not bad and fused > 0 and unfused_left == 0 and fewer and folded
                      and peak_t <= peak_f and measured_ok)
                failures += not ok
                print(f"  N={n} {config:<44} {fused:2d} fused ops, "
                      f"{len(ops(plans['false'])) - len(ops(plans['true'])):3d} fewer instr, "
                      f"peak {peak_f} -> {peak_t} B"
                      + (f" DIFFERS in {', '.join(bad[:3])}" if bad else "")
                      + ("" if folded else " | clipping not folded into every update")
                      + ("" if measured_ok else " | measured != predicted")
                      + f"  {'ok' if ok else 'MISMATCH'}")
    if failures:
        print(f"FAIL: {failures} configuration(s)")
        return 1
    print("fused epilogues are bitwise invisible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
