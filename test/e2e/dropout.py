#!/usr/bin/env python3
"""fsdp.dropout beyond the oracle and the sharding equivalence.

usage: dropout.py BIN_DIR

For the small GPT with dropout 0.1 (examples/gen_models.py --dropout):
(a) gradient accumulation: K = 2 micro-batches on 2 ranks give the losses
    of one rank on the whole global batch within 1e-6 (the micro-batch
    index enters the mask's global element index), with accum-reduce step
    and microbatch, at stages 0 and 3;
(b) recomputation (unit and selective, stage 3 on 2 ranks) is bitwise the
    plan without it: the recomputed dropout regenerates its mask;
(c) evaluation is the identity: with lr 0 the validation losses of the
    dropout model equal those of the same model without dropout, bit for
    bit, while its training losses differ (dropout is on in training);
(d) the mask changes with the step and the seed: two steps at lr 0 give
    different training losses, and so does another --seed.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")
GLOBAL = 8


def main():
    bindir = sys.argv[1]
    failures = []

    with tempfile.TemporaryDirectory() as tmp:
        def gen(batch, p, tag):
            path = os.path.join(tmp, tag + ".mlir")
            subprocess.run([sys.executable, GEN, "gpt", "--vocab", "64", "--ctx", "8",
                            "--layers", "2", "--heads", "2", "--width", "16", "--batch",
                            str(batch), "--dropout", str(p), "-o", path], check=True)
            return path

        def run(model, tag, n, pipeline, steps=6, extra=()):
            plan = os.path.join(tmp, tag + ".plan")
            subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw world-size={n} {pipeline} "
                            f"plan={plan} report=false"], check=True)
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--steps", str(steps),
                                  "--json", "--threads", "1"] + list(extra)
                                 + (["--nproc", str(n)] if n > 1 else []),
                                 check=True, capture_output=True, text=True, timeout=300).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            return ([r["loss"] for r in rows if "step" in r and "loss" in r],
                    [r["val_loss"] for r in rows if "val_loss" in r])

        def rel(a, b):
            return max(abs(x - y) / abs(y) for x, y in zip(a, b))

        # (a) accumulation against one rank on the global batch.
        ref, _ = run(gen(GLOBAL, 0.1, "g8"), "ref", 1, "stage=0", extra=["--lr", "3e-3"])
        micro = gen(GLOBAL // 4, 0.1, "g2")
        for stage in (0, 3):
            for mode in ("step", "microbatch"):
                losses, _ = run(micro, f"acc{stage}{mode}", 2,
                                f"stage={stage} grad-accum=2 accum-reduce={mode}",
                                extra=["--lr", "3e-3"])
                d = rel(losses, ref)
                ok = len(losses) == len(ref) and d <= 1e-6
                print(f"(a) N=2 stage={stage} grad-accum=2 accum-reduce={mode}: max loss rel diff "
                      f"{d:.1e} vs one rank (<= 1e-6)  {'ok' if ok else 'MISMATCH'}")
                if not ok:
                    failures.append(f"accumulation stage {stage} {mode}")

        # (b) recomputation regenerates the masks.
        half = gen(GLOBAL // 2, 0.1, "g4")
        base, _ = run(half, "rc-none", 2, "stage=3", extra=["--lr", "3e-3"])
        for policy in ("unit", "selective"):
            losses, _ = run(half, f"rc-{policy}", 2, f"stage=3 recompute={policy}",
                            extra=["--lr", "3e-3"])
            same = losses == base
            print(f"(b) recompute={policy}: losses {'bitwise equal to' if same else 'DIFFER from'} "
                  f"recompute=none")
            if not same:
                failures.append(f"recompute {policy}")

        # (c) evaluation without dropout; (d) masks move with step and seed.
        opts = ["--lr", "0", "--eval-every", "1", "--eval-batches", "2"]
        drop_train, drop_eval = run(gen(GLOBAL, 0.3, "e3"), "e-drop", 1, "stage=0", 3, opts)
        plain_train, plain_eval = run(gen(GLOBAL, 0.0, "e0"), "e-plain", 1, "stage=0", 3, opts)
        ok = (len(drop_eval) == 4 and drop_eval == plain_eval
              and all(a != b for a, b in zip(drop_train, plain_train)))
        print(f"(c) lr 0: validation losses {drop_eval} with dropout, {plain_eval} without "
              f"({'bitwise equal' if drop_eval == plain_eval else 'DIFFERENT'}); training "
              f"losses differ: {all(a != b for a, b in zip(drop_train, plain_train))}  "
              f"{'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append("evaluation")
        other_seed, _ = run(gen(GLOBAL, 0.3, "e3"), "e-seed", 1, "stage=0", 3,
                            opts + ["--seed", "99"])
        # The batch is the same every step at lr 0 only if the data is; the
        # synthetic token stream differs per step, so compare per step: the
        # same step under another seed must differ, as must plain vs dropout.
        moved = all(a != b for a, b in zip(drop_train, other_seed))
        print(f"(d) another --seed changes every step's mask: {moved}  "
              f"{'ok' if moved else 'MISMATCH'}")
        if not moved:
            failures.append("seed")

    for f in failures:
        print("FAIL:", f)
    print("dropout checks pass" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
