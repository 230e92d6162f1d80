#!/usr/bin/env python3
"""Gradient-accumulation fusion (`fuse-grad-accum`, on by default) against
the unfused step, same model, one run.

With grad-accum=K each later micro-batch's weight-gradient GEMM adds into
the accumulated gradient (beta = 1) instead of writing its product, which
an add then sums into the accumulator (three passes over the gradient:
write, two reads and a write). The model (examples/gen_models.py) is a
Llama-style decoder (--model llama, the default: its linear layers have no
bias, so every projection's gradient is a plain matmul) or the GPT
(--model gpt: its linear layers' weight and bias gradients come from one
matmul_bias_grad, which adds both into their sums); AdamW; 1 thread per
rank. For each
(N, stage): the plan's predicted peak (arena) and the measured step
(median over ROUNDS runs of the median of steps 3..STEPS; the two plans
alternate), and the losses' largest relative difference (the GEMM adds
its blocks of the contraction to the sum one by one: another summation
order).

  bench/grad_accum_fusion.py BIN_DIR [--model llama|gpt] [--steps 12] [--rounds 3] [--k 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "examples", "gen_models.py")
MODELS = {
    "llama": ["llama", "--vocab", "512", "--ctx", "128", "--layers", "4", "--heads", "4",
              "--kv-heads", "2", "--width", "256", "--ffn", "688", "--batch", "4"],
    "gpt": ["gpt", "--vocab", "512", "--ctx", "128", "--layers", "4", "--heads", "4",
            "--width", "256", "--batch", "4"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()
    b = lambda t: os.path.join(a.bindir, t)
    print(f"{a.model} width 256, 4 layers, T=128, micro-batch 4, grad-accum={a.k}")
    print(f"{'N':>2} {'stage':>5} {'peak fused':>11} {'unfused':>11} {'saved':>9} "
          f"{'ms fused':>9} {'unfused':>9} {'speedup':>8} {'loss rel diff':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "m.mlir")
        subprocess.run([sys.executable, GEN] + MODELS[a.model] + ["-o", model], check=True)
        for n, stage in ((1, 0), (2, 2), (2, 3)):
            plans = {}
            for fused in (True, False):
                plan = os.path.join(tmp, f"n{n}s{stage}{fused}.plan")
                subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer=adamw stage={stage} world-size={n} "
                                f"grad-accum={a.k} fuse-grad-accum={str(fused).lower()} "
                                f"plan={plan} report=false"], check=True)
                plans[fused] = plan
            ms = {True: [], False: []}
            peak, losses = {}, {}
            for _ in range(a.rounds):
                for fused, plan in plans.items():
                    out = subprocess.run(
                        [b("fsdp-run"), plan, "--threads", "1", "--steps", str(a.steps), "--json"]
                        + (["--nproc", str(n)] if n > 1 else []),
                        check=True, capture_output=True, text=True).stdout
                    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
                    summary = rows[-1]
                    assert summary["predicted_peak"] == summary["measured_high_water"], summary
                    peak[fused] = summary["predicted_peak"]
                    rows = [r for r in rows if "step" in r and not r.get("summary")]
                    ms[fused].append(statistics.median(r["ms"] for r in rows[2:]))
                    losses[fused] = [r["loss"] for r in rows]
            f, u = statistics.median(ms[True]), statistics.median(ms[False])
            diff = max(abs(x - y) / abs(y) for x, y in zip(losses[True], losses[False]))
            print(f"{n:>2} {stage:>5} {peak[True] / 2**20:>9.2f}Mi {peak[False] / 2**20:>9.2f}Mi "
                  f"{(peak[False] - peak[True]) / 2**20:>7.2f}Mi {f:>9.1f} {u:>9.1f} "
                  f"{u / f:>7.3f}x {diff:>14.2e}")


if __name__ == "__main__":
    main()
