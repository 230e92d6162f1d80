#!/usr/bin/env python3
"""Gradient accumulation is a refactoring of the large batch.

For a model written for a micro-batch of B rows, compiles it with
grad-accum=K (each reduction mode) and, as the reference, the same model
written for K*B rows with grad-accum=1; for every N in the list and every
stage (and reshard-after-forward true, false and to each intermediate group
G for stage 3) runs both for S
steps on N ranks (the same K*B rows per rank and step) and checks that the
per-step losses agree within RTOL (relative) and, for SGD, that the
consolidated final parameters agree (1e-4 of each tensor's largest value,
as test/e2e/shard_equivalence.py). Also prints each plan's peak memory per
rank and its gradient and activation parts, against the reference's, and
checks that fewer activation bytes are live (one micro-batch's at a time)
and that microbatch mode at stages 2/3 (N >= 2) needs fewer gradient bytes
than step mode (no whole gradient persists between micro-batches).

usage: grad_accum.py BIN_DIR mlp|gpt OPTIMIZER STEPS RTOL K B N [N ...]

OPTIMIZER is a pipeline fragment such as "adamw" or "sgd momentum=0.9".
Under AdamW only the losses are compared (shard_equivalence.py says why).
The two programs differ only in summation order (K partial matmul sums
over B rows instead of one over K*B, the mean taken as 1/K of means of B),
so they agree to rounding; RTOL is the issue's bound.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from shard_equivalence import differences, gen, read_f32  # noqa: E402


def run(bindir, model, tmp, tag, n, pipeline, steps, optimizer):
    plan = os.path.join(tmp, tag + ".plan")
    subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                    f"--fsdp-pipeline=optimizer={optimizer} max-grad-norm=1.0 {pipeline} "
                    f"world-size={n} plan={plan} report=false"], check=True)
    with open(plan) as f:
        memory = json.load(f)["memory"]
    save = os.path.join(tmp, tag + ".safetensors")
    out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--steps", str(steps),
                          "--lr", "1e-2", "--json", "--threads", "1", "--save", save]
                         + (["--nproc", str(n)] if n > 1 else []),
                         check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    losses = [r["loss"] for r in rows if "step" in r]
    return losses, read_f32(save), memory


def main():
    bindir, kind, optimizer = sys.argv[1], sys.argv[2], sys.argv[3]
    steps, rtol = int(sys.argv[4]), float(sys.argv[5])
    k, micro = int(sys.argv[6]), int(sys.argv[7])
    worlds = [int(a) for a in sys.argv[8:]]
    compare_params = not optimizer.startswith("adamw")
    failures = 0
    kib = lambda b: f"{b / 1024:8.1f} KiB"
    with tempfile.TemporaryDirectory() as tmp:
        small = os.path.join(tmp, "micro.mlir")
        big = os.path.join(tmp, "big.mlir")
        gen(kind, micro, small)
        gen(kind, k * micro, big)
        print(f"{kind} ({optimizer}): {k} micro-batches of {micro} rows vs one batch of "
              f"{k * micro} rows per rank, {steps} steps")
        for n in worlds:
            # reshard-after-forward: true, false, and G (hpZ) for 1 < G < N.
            configs = [(s, "true") for s in range(4)] + [(3, "false")] + \
                [(3, str(g)) for g in range(2, n) if n % g == 0]
            for stage, reshard in configs:
                pipe = f"stage={stage} reshard-after-forward={reshard}"
                tag = f"n{n}s{stage}r{reshard}"
                ref_losses, ref_params, ref_mem = run(bindir, big, tmp, tag + "ref", n, pipe,
                                                      steps, optimizer)
                for mode in ("step", "microbatch"):
                    losses, params, mem = run(
                        bindir, small, tmp, f"{tag}{mode}", n,
                        f"{pipe} grad-accum={k} accum-reduce={mode}", steps, optimizer)
                    loss_err, param_err = differences(losses, ref_losses, params,
                                                      ref_params)
                    # Memory, from the plans: one micro-batch's activations
                    # live at a time (fewer than the batch's); step mode
                    # keeps the whole gradient between micro-batches, and
                    # microbatch mode at stages 2/3 on N >= 2 ranks keeps
                    # only shards, so it needs fewer gradient bytes.
                    if mode == "step":
                        step_grads = mem["grads"]
                    mem_ok = (mem["activations"] < ref_mem["activations"]
                              and (mode != "microbatch" or stage < 2 or n < 2
                                   or mem["grads"] < step_grads))
                    ok = (len(losses) == len(ref_losses) == steps and loss_err <= rtol
                          and (not compare_params or param_err <= 1e-4) and mem_ok)
                    failures += not ok
                    print(f"  N={n} stage={stage} reshard={reshard:<5} "
                          f"{mode:<10} loss diff {loss_err:.2e} param diff {param_err:.2e}  "
                          f"peak {kib(mem['peak'])} (batch {kib(ref_mem['peak'])})  "
                          f"grads {kib(mem['grads'])} ({kib(ref_mem['grads'])})  "
                          f"activations {kib(mem['activations'])} "
                          f"({kib(ref_mem['activations'])})  "
                          f"{'ok' if ok else 'MISMATCH' + ('' if mem_ok else ' (memory)')}")
    if not compare_params:
        print("(final parameters not compared under AdamW: see shard_equivalence.py)")
    print("every accumulated run matches the large batch" if not failures
          else f"FAIL: {failures} configuration(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
