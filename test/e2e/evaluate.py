#!/usr/bin/env python3
"""Validation loss (fsdp-run --eval-every) is the training step's forward
pass and nothing else.

A small GPT on byte-level text (llm.c token files: training on GPL-3,
validation on the Apache-2.0 licence text, both shipped by Debian), for
each configuration below:
  1. training with evaluations is bitwise training without: the same
     per-step losses and the same final parameters, byte for byte
     (an evaluation that wrote a parameter, an optimizer state or a
     gradient carried into the next step would change them);
  2. evaluated on the training file with --eval-batches 1 before the first
     step, the validation loss is bitwise the first step's training loss
     (the same batch through the same instructions);
  3. evaluations come before the first step, every N steps and after the
     last one;
  4. the validation loss of N ranks equals one rank's within RTOL, the
     tolerance the training losses of the same runs are held to
     (shard_equivalence.py: only the reductions' order differs);
  5. after training, the validation loss is below its start (the model
     learns the text's byte statistics, which the held-out text shares).
Configurations: 1 rank; 2 ranks at stage 3 (a prefetched all-gather is in
flight when the loss is computed, and the loss's all-reduce comes last);
2 ranks at stage 1; 1 rank with gradient accumulation (the evaluation runs
the first micro-batch's backward pass too, and drops it); unit
recomputation; a 2x2 hybrid-sharded mesh; bf16 on 2 ranks and f16 with
dynamic loss scaling on one (checks 1-3 and 5).

usage: evaluate.py BIN_DIR RTOL
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
GEN = os.path.join(ROOT, "examples", "gen_models.py")
TOKENS = os.path.join(ROOT, "tools", "make_tokens.py")
GLOBAL_BATCH = 4
STEPS, EVERY = 7, 3


def main():
    bindir, rtol = sys.argv[1], float(sys.argv[2])
    opt_bin, run_bin = os.path.join(bindir, "fsdp-opt"), os.path.join(bindir, "fsdp-run")
    failures = 0

    def check(ok, what):
        nonlocal failures
        print(("ok   " if ok else "FAIL ") + what)
        failures += 0 if ok else 1

    with tempfile.TemporaryDirectory() as tmp:
        train = os.path.join(tmp, "train.bin")
        held = os.path.join(tmp, "held.bin")
        subprocess.run([sys.executable, TOKENS, "/usr/share/common-licenses/GPL-3", "-o", train],
                       check=True)
        subprocess.run([sys.executable, TOKENS, "/usr/share/common-licenses/Apache-2.0",
                        "-o", held], check=True)

        def plan(tag, n, pipeline, micro=1):
            model = os.path.join(tmp, f"{tag}.mlir")
            subprocess.run([sys.executable, GEN, "gpt", "--vocab", "256", "--ctx", "16",
                            "--layers", "2", "--heads", "2", "--width", "32",
                            "--batch", str(GLOBAL_BATCH // (n * micro)), "-o", model], check=True)
            path = os.path.join(tmp, f"{tag}.plan")
            subprocess.run([opt_bin, model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw max-grad-norm=1.0 {pipeline} "
                            f"world-size={n} plan={path} report=false"], check=True)
            return path

        def run(path, n, tag, extra):
            save = os.path.join(tmp, f"{tag}.safetensors")
            out = subprocess.run([run_bin, path, "--data", train, "--steps", str(STEPS),
                                  "--lr", "3e-3", "--json", "--threads", "1", "--save", save]
                                 + (["--nproc", str(n)] if n > 1 else []) + extra,
                                 check=True, capture_output=True, text=True, timeout=300).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            losses = [r["loss"] for r in rows if "loss" in r and not r.get("eval")]
            evals = [(r["step"], r["val_loss"]) for r in rows if r.get("eval")]
            with open(save, "rb") as f:
                params = f.read()
            return losses, evals, params

        configs = [("1 rank", 1, "stage=0", 1, True),
                   ("2 ranks, stage 3", 2, "stage=3", 1, True),
                   ("2 ranks, stage 1", 2, "stage=1", 1, True),
                   ("1 rank, 2 micro-batches", 1, "stage=0 grad-accum=2", 2, True),
                   ("2 ranks, stage 3, unit recomputation", 2, "stage=3 recompute=unit", 1, True),
                   ("4 ranks, 2x2 hybrid sharding", 4, "stage=3 mesh=2x2", 1, True),
                   ("4 ranks, stage 3, resharding to 2 (hpZ)", 4,
                    "stage=3 reshard-after-forward=2", 1, True),
                   ("2 ranks, stage 3, bf16", 2, "stage=3 param-dtype=bf16", 1, False),
                   ("1 rank, f16 with loss scaling", 1,
                    "stage=0 param-dtype=f16 loss-scale=dynamic", 1, False)]
        reference = None
        for name, n, pipeline, micro, exact in configs:
            tag = name.replace(" ", "_").replace(",", "")
            p = plan(tag, n, pipeline, micro)
            base_losses, none, base_params = run(p, n, tag + "_base", [])
            losses, evals, params = run(p, n, tag + "_eval",
                                        ["--eval-every", str(EVERY), "--eval-data", held])
            check(not none and losses == base_losses and params == base_params,
                  f"{name}: training with evaluations is bitwise training without "
                  f"({len(losses)} losses, {len(params)} parameter bytes)")
            want = [0] + list(range(EVERY, STEPS + 1, EVERY)) + \
                ([STEPS] if STEPS % EVERY else [])
            check([s for s, _ in evals] == want,
                  f"{name}: evaluated after steps {[s for s, _ in evals]} (want {want})")
            check(evals[-1][1] < evals[0][1],
                  f"{name}: validation loss {evals[0][1]:.6f} -> {evals[-1][1]:.6f} after "
                  f"{STEPS} steps")
            _, first, _ = run(p, n, tag + "_same", ["--eval-every", str(STEPS), "--eval-data",
                                                    train, "--eval-batches", "1"])
            check(first[0][1] == base_losses[0],
                  f"{name}: on the training file before step 1 the validation loss "
                  f"{first[0][1]!r} is the first training loss {base_losses[0]!r}")
            if not exact:
                continue
            if reference is None:
                reference = evals
                continue
            err = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(evals, reference))
            check(len(evals) == len(reference) and err <= rtol,
                  f"{name}: validation losses equal one rank's within {rtol:g} "
                  f"(largest relative difference {err:.2e})")
    print("evaluation is the forward pass" if not failures else f"FAIL: {failures} check(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
