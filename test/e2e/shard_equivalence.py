#!/usr/bin/env python3
"""Sharded training is a refactoring of unsharded training.

For a model written for a global batch G, compiles the one-rank plan and,
for every N in the list and every stage (and reshard-after-forward both
ways for stage 3, and to every intermediate group G, 1 < G < N, G
dividing N: hpZ), the N-rank plan of the same model with per-rank batch
G / N; runs each for S steps and checks that the per-step losses and
gradient norms (before clipping; every plan clips at 1.0) equal the
one-rank ones within RTOL (relative; the norms after step 1 within 10
RTOL, see the comment in main) and that the consolidated final
parameters match. Also prints communication bytes per rank per step.

usage: shard_equivalence.py BIN_DIR mlp|gpt|llama[,dropout=P] OPTIMIZER STEPS RTOL N [N ...]

With dropout (mlp, gpt) every rank drops the elements one rank drops for
the same global rows (fsdp.dropout keys its mask by the global index).

OPTIMIZER is a pipeline fragment such as "adamw" or "sgd momentum=0.9".
Final parameters are compared (1e-4 of each tensor's largest value) for
SGD only: AdamW normalizes rounding-level gradients into +-lr steps (the GPT
attention key bias has an identically zero gradient, softmax being
shift-invariant), so those elements random-walk differently under any
change of summation order while the losses still match.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")
GLOBAL_BATCH = 12


def read_f32(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        out[name] = struct.unpack(f"<{(hi - lo) // 4}f", data[8 + n + lo:8 + n + hi])
    return out


def differences(losses, ref_losses, params, ref_params):
    """Largest relative loss difference over the steps, and largest
    parameter difference relative to each tensor's largest value."""
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_err = 0.0
    for name, ref in ref_params.items():
        scale = max(max(abs(v) for v in ref), 1e-12)
        d = max(abs(a - b) for a, b in zip(params[name], ref))
        param_err = max(param_err, d / scale)
    return loss_err, param_err


def gen(kind, batch, path):
    # "gpt,dropout=0.1": the model with gen_models.py --dropout 0.1.
    kind, _, opt = kind.partition(",")
    extra = ["--dropout", opt.split("=")[1]] if opt.startswith("dropout=") else []
    if kind == "mlp":
        args = ["mlp", "--hidden", "32", "--blocks", "4", "--batch", str(batch)]
    elif kind == "llama":
        args = ["llama", "--vocab", "64", "--ctx", "8", "--layers", "2", "--heads", "4",
                "--kv-heads", "2", "--width", "16", "--ffn", "40", "--batch", str(batch)]
    else:
        args = ["gpt", "--vocab", "64", "--ctx", "8", "--layers", "2", "--heads", "2",
                "--width", "16", "--batch", str(batch)]
    subprocess.run([sys.executable, GEN] + args + extra + ["-o", path], check=True)


def norms_match(norms, ref_norms, rtol):
    """The global gradient norms (before clipping) of each step against the
    one-rank run's: (ok, step 1's relative difference, the largest).

    At step 1 the parameters are the same and only the summation order
    differs: within RTOL, as the loss. Later steps start from parameters
    that differ by earlier steps' rounding, and a gradient, a difference of
    terms that cancel, carries more of it relative to its size than the
    loss: within 10 RTOL there (measured: up to 6e-7 with RTOL 1e-6, the
    MLP under AdamW at 3 ranks)."""
    if len(norms) != len(ref_norms) or not norms:
        return False, float("inf"), float("inf")
    rel = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
    return rel[0] <= rtol and max(rel) <= 10 * rtol, rel[0], max(rel)


# fsdp-run's arguments for runs of more than one rank (--nnodes).
MULTI_RANK_ARGS = []


def take_nnodes(argv):
    """A leading `--nnodes K` in argv (removed): every run of N ranks as K
    nodes of N / K consecutive ranks (`fsdp-run --nnodes`: shared memory
    within a node, Gloo between them)."""
    if len(argv) > 2 and argv[1] == "--nnodes":
        MULTI_RANK_ARGS[:] = ["--nnodes", argv[2]]
        del argv[1:3]
        print(f"ranks as {MULTI_RANK_ARGS[1]} nodes (fsdp-run --nnodes)")


def run(bindir, model, tmp, tag, n, pipeline, steps, optimizer):
    plan = os.path.join(tmp, tag + ".plan")
    subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                    f"--fsdp-pipeline=optimizer={optimizer} max-grad-norm=1.0 {pipeline} "
                    f"world-size={n} plan={plan} report=false"], check=True)
    save = os.path.join(tmp, tag + ".safetensors")
    out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--steps", str(steps),
                          "--lr", "1e-2", "--json", "--threads", "1", "--save", save]
                         + (["--nproc", str(n)] + MULTI_RANK_ARGS if n > 1 else []),
                         check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    losses = [r["loss"] for r in rows if "step" in r]
    norms = [r["grad_norm"] for r in rows if "step" in r]
    comm = rows[-1].get("comm_bytes_per_step", 0)
    return losses, norms, read_f32(save), comm


def main():
    take_nnodes(sys.argv)
    bindir, kind, optimizer = sys.argv[1], sys.argv[2], sys.argv[3]
    steps, rtol = int(sys.argv[4]), float(sys.argv[5])
    worlds = [int(a) for a in sys.argv[6:]]
    failures = 0
    # AdamW divides every gradient by the root of its running square, so an
    # element whose gradient is at the rounding level moves by up to lr per
    # step in a direction set by the rounding: a change of summation order
    # (N ranks) moves it differently, and the final parameters cannot be
    # compared element by element. The losses are compared at every step;
    # the sharded AdamW update itself is checked per element against
    # PyTorch in float64 by test/lit/e2e/torch-oracle.test (teacher forcing).
    compare_params = optimizer.startswith("sgd")
    with tempfile.TemporaryDirectory() as tmp:
        ref_model = os.path.join(tmp, "g.mlir")
        gen(kind, GLOBAL_BATCH, ref_model)
        ref_losses, ref_norms, ref_params, _ = run(bindir, ref_model, tmp, "ref", 1, "stage=0", steps,
                                              optimizer)
        print(f"{kind} ({optimizer}): one-rank reference, global batch {GLOBAL_BATCH}, {steps} steps, "
              f"losses {ref_losses[0]:.6f} .. {ref_losses[-1]:.6f}")
        for n in worlds:
            model = os.path.join(tmp, f"b{n}.mlir")
            gen(kind, GLOBAL_BATCH // n, model)
            # Per-unit resharding (reshard-units=1: the first unit reshards,
            # the later ones keep their gather) is, like hpZ, bitwise
            # resharding to all.
            hpz = [str(g) for g in range(2, n) if n % g == 0]
            configs = [(s, "true") for s in range(4)] + [(3, "false")] + \
                [(3, g) for g in hpz] + \
                [(3, f"{r} reshard-units=1") for r in ["true"] + hpz[:1]]
            for stage, reshard in configs:
                tag = f"n{n}s{stage}r{reshard}".replace(" ", "_").replace("=", "")
                pipe = f"stage={stage} reshard-after-forward={reshard}"
                losses, norms, params, comm = run(bindir, model, tmp, tag, n, pipe, steps,
                                                  optimizer)
                loss_err, param_err = differences(losses, ref_losses, params, ref_params)
                norm_ok, norm_first, norm_err = norms_match(norms, ref_norms, rtol)
                ok = (len(losses) == len(ref_losses) and loss_err <= rtol and norm_ok
                      and (not compare_params or param_err <= 1e-4))
                # Resharding to G ranks gathers the same bits for backward
                # as resharding to all: bitwise the same losses and params.
                if stage == 3 and reshard == "true":
                    resharded = (losses, params)
                elif stage == 3 and reshard != "false":
                    same = resharded == (losses, params)
                    ok = ok and same
                    print(f"  N={n} stage=3 reshard={reshard}: losses and parameters "
                          f"{'bitwise equal to' if same else 'DIFFER from'} reshard=true")
                failures += not ok
                print(f"  N={n} stage={stage} reshard={reshard:<5} "
                      f"max loss rel diff {loss_err:.2e}  norm {norm_first:.1e} / {norm_err:.1e}  "
                      f"max param diff {param_err:.2e}  "
                      f"comm/rank/step {comm:>9} B  {'ok' if ok else 'MISMATCH'}")
    if not compare_params:
        print("(final parameters not compared under AdamW: see the comment above)")
    print("all sharded runs match the one-rank run" if not failures
          else f"FAIL: {failures} configuration(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
