#!/usr/bin/env python3
"""Dynamic loss scaling and f16 mixed precision end to end on CPU ranks.

usage: loss_scaling.py BIN_DIR exact          (a) scaling changes no bit (f32 compute)
       loss_scaling.py BIN_DIR f16            (b) f16: N ranks vs 1 rank, resume
       loss_scaling.py BIN_DIR text TOKENS    (c) 200 steps of the small GPT, f16 vs f32

(a) With f32 compute, `loss-scale=dynamic` multiplies d(loss) by a power of
    two S and fsdp.grad_coef divides it out again. Every rounding is
    invariant under a power-of-two scale as long as nothing overflows or
    turns subnormal (fl(S x) = S fl(x)): each backward op is linear in its
    incoming gradient, the squared norm scales by S^2 exactly (double
    accumulation of exact products), sqrt(S^2 s) = S sqrt(s), and the
    factor fl(c)/S times S g is fl(c) g. So the scaled plan must reproduce
    the unscaled one bit for bit: losses and final parameters, at stages
    0-3 on 1 and 2 ranks, AdamW and SGD with momentum, with and without
    clipping, and with gradient accumulation.

(b) f16 (param-dtype=f16, loss scaling on by default) on 1 rank vs N = 2, 3
    ranks of the same global batch at stages 0-3 (reduce-dtype f16 and
    f32): every step's loss within D u (relative) of one rank, u = 2^-11
    the unit roundoff of f16 (11 significant bits) and D the number of
    forward instructions that write an f16 tensor before the loss (each
    such rounding may differ between two runs by at most u relative, to
    first order these add up; the derivation of test/e2e/mixed_precision.py
    with f16's u). The scale each rank used and the steps it skipped are
    the same as one rank's. A run of 6 steps equals 3 steps + --resume 3
    steps bit for bit, with a growth interval of 2 so the scaler's state
    crosses the checkpoint.

(c) The small GPT on text tokens, 200 steps, f16 vs f32: 50-step window
    means of the loss within D u (f16's u), and the f16 run learns.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# The helpers (and the bf16 derivation this one follows) of the bf16 test.
_spec = importlib.util.spec_from_file_location(
    "mixed_precision", os.path.join(HERE, "mixed_precision.py"))
mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mp)
U16 = mp.UNIT_ROUNDOFF["f16"]
GLOBAL_BATCH = 12


def mlp(batch, path):
    mp.gen(["mlp", "--hidden", "32", "--blocks", "3", "--batch", str(batch)], path)


def compile_plan(bindir, model, path, pipeline):
    """As mp.compile_plan, with the optimizer in `pipeline` too."""
    subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                    f"--fsdp-pipeline={pipeline} plan={path} report=false"], check=True)
    with open(path) as f:
        return json.load(f)


run = mp.run_rows
rounding_depth = mp.rounding_depth


def check_exact(bindir, tmp):
    failures = 0
    steps = 8
    cases = [  # (N, stage, optimizer options, extra)
        (1, 0, "optimizer=adamw", ""),
        (1, 0, "optimizer=adamw max-grad-norm=0.5", ""),
        (1, 0, "optimizer=sgd momentum=0.9 max-grad-norm=0.5", ""),
        (2, 0, "optimizer=adamw max-grad-norm=0.5", ""),
        (2, 1, "optimizer=adamw max-grad-norm=0.5", ""),
        (2, 2, "optimizer=adamw", ""),
        (2, 3, "optimizer=adamw max-grad-norm=0.5", ""),
        (2, 3, "optimizer=sgd momentum=0.9", ""),
        (2, 3, "optimizer=adamw max-grad-norm=0.5", "grad-accum=2"),
    ]
    print(f"(a) f32 compute, loss-scale=dynamic (S = 2^16) vs no scaling, {steps} steps: "
          "bitwise")
    for n, stage, opt, extra in cases:
        model = os.path.join(tmp, f"x{n}.mlir")
        if not os.path.exists(model):
            mlp(GLOBAL_BATCH // n, model)
        got = {}
        for scaled in (False, True):
            plan = os.path.join(tmp, f"x{n}{stage}{scaled}.plan")
            pipeline = (f"{opt} world-size={n} stage={stage} {extra}"
                        + (" loss-scale=dynamic" if scaled else ""))
            compile_plan(bindir, model, plan, pipeline)
            final = os.path.join(tmp, f"x{n}{stage}{scaled}.safetensors")
            rows, _ = run(bindir, plan, n, steps, ["--lr", "1e-2", "--save", final])
            with open(final, "rb") as f:
                got[scaled] = ([r["loss"] for r in rows], f.read(),
                               [r.get("skipped") for r in rows])
        same_loss = got[False][0] == got[True][0]
        same_params = got[False][1] == got[True][1]
        no_skip = not any(got[True][2])
        ok = same_loss and same_params and no_skip
        failures += not ok
        print(f"  N={n} stage={stage} {opt} {extra}: losses "
              f"{'equal' if same_loss else 'DIFFER'}, final parameters "
              f"{'equal' if same_params else 'DIFFER'}, no step skipped "
              f"{'yes' if no_skip else 'NO'}  {'ok' if ok else 'MISMATCH'}")
    return failures


def check_f16(bindir, tmp):
    failures = 0
    steps = 10
    ref_model = os.path.join(tmp, "g.mlir")
    mlp(GLOBAL_BATCH, ref_model)
    ref_plan = compile_plan(bindir, ref_model, os.path.join(tmp, "ref.plan"),
                            "optimizer=adamw param-dtype=f16 reduce-dtype=f16 stage=0")
    if "loss_scale" not in ref_plan:
        print("f16 plan without loss_scale: MISMATCH")
        return 1
    depth = rounding_depth(ref_plan, "f16")
    rtol = depth * U16
    ref_rows, _ = run(bindir, os.path.join(tmp, "ref.plan"), 1, steps)
    ref = [r["loss"] for r in ref_rows]
    ref_scales = [(r["loss_scale"], r["skipped"]) for r in ref_rows]
    print(f"(b) mlp f16, one rank, global batch {GLOBAL_BATCH}, {steps} steps: losses "
          f"{ref[0]:.6f} .. {ref[-1]:.6f}; D = {depth} f16 roundings before the loss, "
          f"tolerance D u = {rtol:.5f}; loss scale {ref_scales[0][0]:g}, "
          f"{sum(s for _, s in ref_scales)} step(s) skipped")
    for n in (2, 3):
        model = os.path.join(tmp, f"b{n}.mlir")
        mlp(GLOBAL_BATCH // n, model)
        for stage in range(4):
            for reduce in ("f16", "f32") if stage in (0, 3) else ("f16",):
                plan = os.path.join(tmp, f"n{n}s{stage}{reduce}.plan")
                compile_plan(bindir, model, plan,
                             f"optimizer=adamw param-dtype=f16 reduce-dtype={reduce} "
                             f"world-size={n} stage={stage}")
                rows, _ = run(bindir, plan, n, steps)
                losses = [r["loss"] for r in rows]
                scales = [(r["loss_scale"], r["skipped"]) for r in rows]
                err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
                ok = len(losses) == steps and err <= rtol and scales == ref_scales
                failures += not ok
                print(f"  N={n} stage={stage} reduce={reduce:<3} max rel diff {err:.2e} "
                      f"(<= {rtol:.5f}), scales and skips as one rank: "
                      f"{'yes' if scales == ref_scales else 'NO'}  "
                      f"{'ok' if ok else 'MISMATCH'}")

    # Resume: the scaler's state (scale, growth tracker, skipped steps)
    # travels in the checkpoint.
    model = os.path.join(tmp, "b2.mlir")
    plan = os.path.join(tmp, "resume.plan")
    compile_plan(bindir, model, plan, "optimizer=adamw param-dtype=f16 world-size=2 "
                 "stage=3 loss-scale-growth-interval=2")
    straight, _ = run(bindir, plan, 2, 6)
    ck = os.path.join(tmp, "ck")
    first, _ = run(bindir, plan, 2, 3, ["--ckpt-dir", ck])
    second, _ = run(bindir, plan, 2, 6, ["--resume", ck])
    key = lambda rows: [(r["loss"], r["loss_scale"], r["skipped"]) for r in rows]
    ok = key(straight) == key(first) + key(second)
    grew = len({r["loss_scale"] for r in straight}) > 1
    failures += not (ok and grew)
    print(f"  resume after 3 of 6 steps (growth interval 2): losses, scales and skips "
          f"{'equal' if ok else 'DIFFER'} to the straight run; scale changed "
          f"{'yes' if grew else 'NO'} ({straight[0]['loss_scale']:g} -> "
          f"{straight[-1]['loss_scale']:g})  {'ok' if ok and grew else 'MISMATCH'}")
    return failures


def main():
    bindir, mode = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "exact":
            failures = check_exact(bindir, tmp)
        elif mode == "f16":
            failures = check_f16(bindir, tmp)
        elif mode == "text":
            failures = mp.check_text(bindir, tmp, sys.argv[3], dtype="f16", label="c")
        else:
            raise SystemExit(__doc__)
    print("loss scaling checks pass" if not failures
          else f"FAIL: {failures} check(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
