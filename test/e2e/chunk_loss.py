#!/usr/bin/env python3
"""The LM head and its cross-entropy in row chunks (loss-chunks,
fsdp-chunk-loss) with the rest of the compiler and the runtime.

usage: chunk_loss.py BIN_DIR

(a) With every pass that meets the chunked head (ZeRO 1-3, reshard-after-
    forward=false, unit recomputation, activation and optimizer offload,
    gradient accumulation reducing each micro-batch, bf16 with clipping,
    the unfused ops, the memory-budget search), loss-chunks=3 trains as
    loss-chunks=1: the losses of 6 steps within 1e-5 relative (the same
    values summed in another order; PyTorch checks the values themselves
    in test/lit/e2e/chunk-loss.test), and fsdp-run measures the arenas the
    plan predicts. In bf16 another order of an f32 sum may round a bf16
    activation to its neighbour: there within D u (mixed_precision.py's
    bound, D the bf16 roundings before the loss, u = 2^-8); measured 1.1e-5
    on OpenBLAS's SkylakeX kernels, 0 on Haswell's.
(b) The plan has K fused cross-entropies a micro-batch, each over its
    chunk's rows (the counts of --chunks, auto's rule).
(c) Memory, on a GPT whose logits dominate (vocabulary 4096, 512 rows a
    step): the planned peak with K chunks is at most the unchunked one
    less the logits rows no longer held, (M - m) V 4 bytes, plus the input
    gradient's rows before their concat (M C 4): each chunk's weight-
    gradient term is a GEMM accumulating into the sum in place (matmul
    acc; a term of its own would add V C 4); measured == planned. A
    smaller peak for more chunks down to auto's. The same bound for a
    Llama's untied head, whose sum is in the unit's packed gradient.
(d) Refusals: loss-chunks=0 or a word, a count on a model without a
    cross-entropy head; auto there compiles unchanged.
(e) Evaluation (--eval-every: the slice of the step the loss depends on)
    with 3 chunks: validation losses within 1e-5 of 1 chunk's, and the
    training losses bitwise those of a run without evaluations.
"""
import json
import os
import subprocess
import sys
import tempfile

import mixed_precision as mp
from e2e_lib import Checks, arenas_measured_as_planned, gen_models, run_json

# (ranks, pipeline options); every one with loss-chunks=1 and =3.
CONFIGS = [
    (1, "optimizer=adamw max-grad-norm=1.0"),
    (2, "optimizer=adamw stage=3"),
    (2, "optimizer=adamw stage=2 reshard-after-forward=false"),
    (2, "optimizer=adamw stage=1 recompute=unit"),
    (2, "optimizer=adamw stage=3 offload-activations=true offload=optimizer"),
    (2, "optimizer=sgd momentum=0.9 stage=3 grad-accum=2 accum-reduce=microbatch"),
    (2, "optimizer=adamw stage=3 param-dtype=bf16 max-grad-norm=1.0"),
    (2, "optimizer=adamw stage=3 fuse-epilogues=false"),
    (2, "optimizer=adamw stage=3 memory-budget=64MiB"),
]


def main():
    bindir = sys.argv[1]
    report = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        models = gen_models(tmp, {
            "gpt": ["gpt", "--vocab", "256", "--ctx", "32", "--layers", "2", "--heads", "2",
                    "--width", "32", "--batch", "4"],
            "big": ["gpt", "--vocab", "4096", "--ctx", "64", "--layers", "2", "--heads", "2",
                    "--width", "32", "--batch", "8"],
            "mlp": ["mlp", "--hidden", "32", "--blocks", "2", "--batch", "8"],
            "llama": ["llama", "--vocab", "4096", "--ctx", "64", "--layers", "2", "--heads", "2",
                      "--kv-heads", "1", "--width", "32", "--ffn", "64", "--batch", "8"],
        })

        def compile_(model, tag, n, pipeline, ok=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), models[model], "-o",
                                os.devnull, f"--fsdp-pipeline=world-size={n} {pipeline} "
                                f"plan={plan} report=false"], capture_output=True, text=True)
            if not ok:
                return r
            if r.returncode != 0:
                raise SystemExit(f"fsdp-opt failed ({tag}): {r.stderr}")
            with open(plan) as f:
                return plan, json.load(f)

        def fused(plan):
            """Rows of each fused cross-entropy's logits, in program order."""
            return [plan["buffers"][i["in"][0]]["shape"][0] for i in plan["program"]
                    if i["op"] == "cross_entropy_fused"]

        # --- (a) and (b): every pass around the chunked head. ---------------
        for i, (n, pipeline) in enumerate(CONFIGS):
            runs, plans = {}, {}
            for k in (1, 3):
                path, plans[k] = compile_("gpt", f"a{i}-{k}", n, f"{pipeline} loss-chunks={k}")
                runs[k] = run_json(bindir, path, n, "--steps", "6", "--lr", "3e-3",
                                   "--threads", "1")
            (l1, s1), (l3, s3) = runs[1], runs[3]
            worst = max(abs(a - b) / abs(b) for a, b in zip(l3, l1))
            tol = 1e-5
            if "param-dtype=bf16" in pipeline:
                tol = max(tol, mp.U * max(mp.rounding_depth(p) for p in plans.values()))
            report(len(l1) == len(l3) == 6 and worst <= tol,
                   f"(a) n={n} {pipeline}: 6 losses of 3 chunks vs 1, worst relative "
                   f"difference {worst:.2g} (at most {tol:.2g})")
            report(arenas_measured_as_planned(s3, plans[3]) and
                   arenas_measured_as_planned(s1, plans[1]),
                   f"(a) n={n} {pipeline}: arenas measured == planned")
            micro = 2 if "grad-accum=2" in pipeline else 1
            rows = 4 * 32  # a micro-batch's tokens (the model's batch)
            want = [(rows + 2) // 3] * 2 + [rows - 2 * ((rows + 2) // 3)]
            got = fused(plans[3])
            if "fuse-epilogues=false" in pipeline:
                got = [plans[3]["buffers"][x["in"][0]]["shape"][0] for x in plans[3]["program"]
                       if x["op"] == "cross_entropy_grad"]
            report(got == want * micro, f"(b) n={n} {pipeline}: cross-entropies over rows {got}")

        # --- (e) evaluation: the loss's slice of the chunked step. ------------
        evals, trained = {}, {}
        for k in (1, 3):
            path, _ = compile_("gpt", f"e-{k}", 2, f"optimizer=adamw stage=3 loss-chunks={k}")
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), path, "--json", "--nproc",
                                  "2", "--steps", "4", "--lr", "3e-3", "--threads", "1",
                                  "--eval-every", "2"], capture_output=True, text=True,
                                 check=True).stdout
            rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            evals[k] = [r["val_loss"] for r in rows if r.get("eval")]
            trained[k] = [r["loss"] for r in rows if "loss" in r and not r.get("eval")]
        plain, _ = run_json(bindir, compile_("gpt", "e-3", 2, "optimizer=adamw stage=3 "
                                             "loss-chunks=3")[0], 2, "--steps", "4", "--lr",
                            "3e-3", "--threads", "1")
        worst = max(abs(a - b) / abs(b) for a, b in zip(evals[3], evals[1]))
        report(len(evals[3]) == len(evals[1]) == 3 and worst <= 1e-5 and trained[3] == plain,
               f"(e) --eval-every 2 with 3 chunks: validation losses within {worst:.2g} of 1 "
               "chunk's, training bitwise training without evaluations")

        # --- (c) memory on a vocabulary-dominated GPT. ------------------------
        M, V, C = 8 * 64, 4096, 32
        peak = {}
        for k in ("1", "2", "8", "auto"):
            path, plan = compile_("big", f"c-{k}", 2, f"optimizer=adamw stage=3 loss-chunks={k}")
            _, s = run_json(bindir, path, 2, "--steps", "2", "--threads", "1")
            report(arenas_measured_as_planned(s, plan),
                   f"(c) loss-chunks={k}: arenas measured == planned ({s['measured_high_water']})")
            peak[k] = (plan["arena_bytes"], len(fused(plan)))
        base = peak["1"][0]
        for k in ("2", "8", "auto"):
            chunks = peak[k][1]
            m = -(-M // chunks)
            bound = base - (M - m) * V * 4 + M * C * 4
            report(peak[k][0] <= bound,
                   f"(c) loss-chunks={k} ({chunks} chunks of {m} rows): peak {base} -> "
                   f"{peak[k][0]} bytes (at most {bound})")
        # Llama's untied head: its weight gradient's sum is placed in the
        # unit's packed gradient (no copy), so the same bound holds.
        lbase = None
        for k in ("1", "2", "8"):
            path, plan = compile_("llama", f"c-llama-{k}", 2,
                                  f"optimizer=adamw stage=3 loss-chunks={k}")
            _, s = run_json(bindir, path, 2, "--steps", "2", "--threads", "1")
            chunks = len(fused(plan))
            lbase = lbase or plan["arena_bytes"]
            m = -(-M // chunks)
            bound = lbase - (M - m) * V * 4 + M * C * 4
            packs = {i["out"][0] for i in plan["program"] if i["op"] == "pack"}
            # acc += dl^T h: a matmul with an accumulator (fsdp-fuse-epilogues)
            sums = [plan["buffers"][i["out"][0]] for i in plan["program"]
                    if i["op"] == "matmul" and len(i["in"]) == 3 and
                    plan["buffers"][i["out"][0]]["shape"] == [V, C]]
            placed = all(b.get("alias_of") in packs for b in sums)
            report(arenas_measured_as_planned(s, plan) and plan["arena_bytes"] <= bound and
                   len(sums) == chunks - 1 and placed,
                   f"(c) llama, loss-chunks={k} ({chunks} chunks): peak {lbase} -> "
                   f"{plan['arena_bytes']} bytes (at most {bound}), measured == planned; "
                   f"{len(sums)} in-place sums of the head's weight gradient, "
                   f"{'in' if placed else 'NOT in'} its unit's packed gradient")
        report(peak["auto"][1] == M // (4 * C // 4) and
               peak["1"][0] > peak["2"][0] > peak["8"][0] >= peak["auto"][0],
               f"(c) auto: {peak['auto'][1]} chunks of {4 * C // 4} rows (the f32 weight "
               f"gradient's bytes); peaks {peak['1'][0]} > {peak['2'][0]} > {peak['8'][0]} "
               f">= {peak['auto'][0]}")

        # --- (d) refusals. -------------------------------------------------
        for bad, want in (("0", "chunks='0' is not a positive chunk count or auto"),
                          ("many", "chunks='many' is not a positive chunk count or auto")):
            r = compile_("gpt", "d-" + bad, 1, f"loss-chunks={bad}", ok=False)
            report(r.returncode != 0 and want in r.stderr,
                   f"(d) loss-chunks={bad}: refused ({want})")
        r = compile_("mlp", "d-mlp", 1, "loss-chunks=2", ok=False)
        report(r.returncode != 0 and "has no cross_entropy (with its gradient)" in r.stderr,
               "(d) loss-chunks=2 on an MLP with an MSE loss: refused")
        r = compile_("mlp", "d-mlp-auto", 1, "loss-chunks=auto", ok=False)
        report(r.returncode == 0, "(d) loss-chunks=auto on the MLP: compiles, nothing to chunk")
    return report.finish("all loss-chunks checks passed")


if __name__ == "__main__":
    sys.exit(main())
