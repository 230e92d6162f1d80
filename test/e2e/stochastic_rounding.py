#!/usr/bin/env python3
"""Stochastic rounding of the bf16 parameters (fsdp-mixed-precision
stochastic-rounding=true) end to end.

usage: stochastic_rounding.py BIN_DIR shards            (a) N ranks == 1 rank, resume
       stochastic_rounding.py BIN_DIR text TOKENS.bin   (b) 200 steps: f32, nearest, stochastic
       stochastic_rounding.py BIN_DIR cuda RUN_BINARY   (c) --device cuda == the CPU

What stochastic rounding changes: the bf16 copy of each trainable unit's f32
master that a step computes with is rounded up (in magnitude) with
probability equal to the fraction rounding drops, so its expected value is
the master (llm.c rounds its bf16 parameters so). The draw of element g of
unit K at step s is a pure function of (--seed, s, K, g), g counted in the
unit's flat parameters (runtime/core/StochasticRounding.h).

(a) The small GPT, global batch 4: every plan below against the one-rank
    stochastic run, step 1 within 1e-6 and 10 steps within D u (u = 2^-8,
    D the bf16 roundings before the loss; the argument is
    mixed_precision.py's). Step 1 is the check with power: its parameters
    are rounded from the same masters, so its loss differs from one rank's
    only by the f32 order of the loss's mean (< 1e-6) when each rank draws
    what one rank draws for its shard; rounding to nearest instead moves
    the step-1 loss by about 1e-5 here, and any other draw (a shard offset
    wrong, a key of another unit or step) moves it as much, which the
    script measures and requires to exceed 1e-6. The plans: N = 2 at stages
    0-3 (stages within 1e-6 of each other at every step: they sum the same
    terms), HSDP 2x2, stage 3 resharding to 2 of 4 ranks (hpZ), stage 3 with
    the optimizer offloaded, and stage 1 with two micro-batches. Then:
    two one-rank runs are bitwise equal, and a 2-rank ZeRO-3 run
    checkpointed at step 3 and resumed to step 6 is bitwise the
    uninterrupted run (the draw depends on the step, not on the process).
(b) 200 steps on text tokens (mixed_precision.py's (b) setting): f32,
    bf16 rounding to nearest and bf16 rounding stochastically; both bf16
    runs' 50-step window means within D u of f32's, both learn. The
    script prints each run's distance from f32 (the measurement in
    docs/BENCHMARKS.md); it asserts no ordering between the two.
(c) The stochastic plan on --device cuda (RUN_BINARY: fsdp-run-emu here,
    fsdp-run on a GPU) against the CPU device: every step within D u (the
    bf16 kernels differ in f32 summation order; the parameters' rounding is
    the same bits, DeviceConformance.StochasticCastsAreUnbiasedAndShard-
    Invariant), and --cuda-graphs (the step captured once, replayed with
    each step's draw read from device memory) bitwise the eager run.
"""
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mixed_precision as mp  # noqa: E402
from e2e_lib import cuda_runs, main_modes  # noqa: E402

U = 2.0 ** -8
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")
GLOBAL_BATCH = 4
STEPS = 10


def gpt(batch, path):
    if not os.path.exists(path):
        subprocess.run([sys.executable, GEN, "gpt", "--vocab", "256", "--ctx", "32", "--layers",
                        "2", "--heads", "4", "--width", "64", "--batch", str(batch), "-o", path],
                       check=True)
    return path


def rel(a, b):
    return abs(a - b) / abs(b)


def check_shards(bindir, tmp):
    failures = 0
    one = gpt(GLOBAL_BATCH, os.path.join(tmp, "g4.mlir"))
    ref_path = os.path.join(tmp, "sr1.plan")
    plan = mp.compile_plan(bindir, one, ref_path, "param-dtype=bf16 stochastic-rounding=true")
    rtol = mp.rounding_depth(plan) * U
    ref, _ = mp.run(bindir, ref_path, 1, STEPS)
    again, _ = mp.run(bindir, ref_path, 1, STEPS)
    same = again == ref
    failures += not same
    print(f"(a) gpt bf16 stochastic, one rank, {STEPS} steps: losses {ref[0]:.6f} .. "
          f"{ref[-1]:.6f}; tolerance D u = {rtol:.4f}")
    print(f"  a second one-rank run is bitwise the first: {'ok' if same else 'MISMATCH'}")
    rn_path = os.path.join(tmp, "rn1.plan")
    mp.compile_plan(bindir, one, rn_path, "param-dtype=bf16")
    rn, _ = mp.run(bindir, rn_path, 1, 1)
    power = rel(rn[0], ref[0])
    ok = power > 1e-6
    failures += not ok
    print(f"  step 1, rounding to nearest vs stochastically: rel diff {power:.1e} (> 1e-6, so "
          f"step 1 within 1e-6 tells the draws apart)  {'ok' if ok else 'MISMATCH'}")

    def against(n, extra, label, base=None):
        k = int(extra.split("grad-accum=")[1].split()[0]) if "grad-accum=" in extra else 1
        model = gpt(GLOBAL_BATCH // (n * k), os.path.join(tmp, f"g{GLOBAL_BATCH // (n * k)}.mlir"))
        path = os.path.join(tmp, "x.plan")
        mp.compile_plan(bindir, model, path,
                        f"param-dtype=bf16 stochastic-rounding=true world-size={n} {extra}")
        losses, _ = mp.run(bindir, path, n, STEPS)
        err = max(rel(a, b) for a, b in zip(losses, ref))
        first = rel(losses[0], ref[0])
        stages = max(rel(a, b) for a, b in zip(losses, base)) if base else 0.0
        ok = len(losses) == STEPS and first <= 1e-6 and err <= rtol and stages <= 1e-6
        print(f"  N={n} {label:<32} step-1 rel diff {first:.1e} (<= 1e-6), max rel diff "
              f"{err:.2e} (<= {rtol:.4f})"
              + (f", vs stage 0 {stages:.1e} (<= 1e-6)" if base else "")
              + f"  {'ok' if ok else 'MISMATCH'}")
        return ok, losses

    ok, stage0 = against(2, "stage=0", "stage 0")
    failures += not ok
    for stage in (1, 2, 3):
        ok, _ = against(2, f"stage={stage}", f"stage {stage}", stage0)
        failures += not ok
    for n, extra in ((4, "stage=3 mesh=2x2"), (4, "stage=3 reshard-after-forward=2"),
                     (2, "stage=3 offload=optimizer"), (2, "stage=1 grad-accum=2")):
        ok, _ = against(n, extra, extra)
        failures += not ok

    # Resume: 2 ranks at stage 3 save at step 3; the resumed steps 4..6 are
    # bitwise the uninterrupted run's.
    model = gpt(GLOBAL_BATCH // 2, os.path.join(tmp, "g2.mlir"))
    path = os.path.join(tmp, "ck.plan")
    mp.compile_plan(bindir, model, path, "param-dtype=bf16 stochastic-rounding=true "
                    "world-size=2 stage=3")
    ckpt = os.path.join(tmp, "ckpt")
    whole, _ = mp.run(bindir, path, 2, 6)
    mp.run(bindir, path, 2, 3, ["--ckpt-dir", ckpt, "--save-every", "3"])
    rows, _ = mp.run_rows(bindir, path, 2, 6, ["--resume", ckpt])
    resumed = {r["step"]: r["loss"] for r in rows}
    ok = [resumed.get(s) for s in (4, 5, 6)] == whole[3:6]
    failures += not ok
    print(f"  N=2 stage 3 checkpointed at step 3, resumed to 6: bitwise the uninterrupted run: "
          f"{'ok' if ok else 'MISMATCH'}")
    return failures


def check_text(bindir, tmp, tokens):
    failures = 0
    model = os.path.join(HERE, "..", "..", "examples", "gpt_small.mlir")
    args = ["--data", tokens, "--lr", "1e-3", "--schedule", "cosine", "--warmup", "10",
            "--threads", "2"]
    runs, depth = {}, None
    for label, pipeline in (("f32", "param-dtype=f32"), ("nearest", "param-dtype=bf16"),
                            ("stochastic", "param-dtype=bf16 stochastic-rounding=true")):
        path = os.path.join(tmp, f"text_{label}.plan")
        plan = mp.compile_plan(bindir, model, path, f"max-grad-norm=1.0 {pipeline}")
        if label == "stochastic":
            depth = mp.rounding_depth(plan)
        rows, _ = mp.run_rows(bindir, path, 1, 200, args)
        runs[label] = [r["loss"] for r in rows]
    rtol = depth * U
    print(f"(b) gpt_small on text, 200 steps: D = {depth}, tolerance D u = {rtol:.4f} on "
          f"50-step window means")
    f32 = mp.window_means(runs["f32"])
    dist = {}
    for label in ("nearest", "stochastic"):
        means = mp.window_means(runs[label])
        dist[label] = [rel(a, b) for a, b in zip(means, f32)]
        for w, (a, b) in enumerate(zip(means, f32)):
            ok = rel(a, b) <= rtol
            failures += not ok
            print(f"  steps {w * 50 + 1:>3}..{(w + 1) * 50:<3} mean loss f32 {b:.4f} bf16 "
                  f"{label:<10} {a:.4f} rel diff {rel(a, b):.4f}  {'ok' if ok else 'MISMATCH'}")
        last = sum(runs[label][150:]) / 50
        ok = last < 0.6 * math.log(256)
        failures += not ok
        print(f"  bf16 {label} last-window mean {last:.4f} < 0.6 ln 256: "
              f"{'ok' if ok else 'MISMATCH'}")
    final = {k: sum(v[190:]) / 10 for k, v in runs.items()}
    print("  measured: mean rel distance of the window means from f32: nearest "
          f"{sum(dist['nearest']) / 4:.5f}, stochastic {sum(dist['stochastic']) / 4:.5f}; "
          f"steps 191-200 mean loss f32 {final['f32']:.4f}, nearest {final['nearest']:.4f}, "
          f"stochastic {final['stochastic']:.4f}")
    return failures


def check_cuda(bindir, tmp, runner):
    failures = 0
    model = gpt(GLOBAL_BATCH, os.path.join(tmp, "g4.mlir"))
    path = os.path.join(tmp, "c.plan")
    plan = mp.compile_plan(bindir, model, path, "param-dtype=bf16 stochastic-rounding=true")
    rtol = mp.rounding_depth(plan) * U

    cpu, cuda, graphs = cuda_runs(bindir, runner, path)
    err = max(rel(a, b) for a, b in zip(cuda, cpu))
    ok = len(cuda) == 6 and err <= rtol
    failures += not ok
    print(f"(c) bf16 stochastic on cuda vs cpu, 6 steps: max rel diff {err:.2e} (<= D u = "
          f"{rtol:.4f})  {'ok' if ok else 'MISMATCH'}")
    ok = graphs == cuda
    failures += not ok
    print(f"  --cuda-graphs (steps 3-6 replayed) == eager bitwise: {'ok' if ok else 'MISMATCH'}")
    return failures


def main():
    return main_modes(__doc__, "stochastic rounding checks pass",
                      {"shards": (0, check_shards), "text": (1, check_text),
                       "cuda": (1, check_cuda)})

if __name__ == "__main__":
    sys.exit(main())
