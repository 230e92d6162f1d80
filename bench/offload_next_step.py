#!/usr/bin/env python3
"""Offloaded updates joined in the next step (offload-next-step): what it buys.

With optimizer offload (offload=optimizer) and overlap, each host update
runs beside the backward pass as soon as its gradient is on the host, one
in flight. With clipping (max-grad-norm) or f16 loss scaling every update
needs the global norm, so all of them start after the whole backward pass
and compute waits for each before the step ends. offload-next-step=true
joins them in the next step instead, each right before its unit's first
use (its gathered parameters in the forward pass), so they run beside the
next forward pass. The host arena then keeps every update's gradient copy
through the step.

Two parts, one run:
1. predicted (h100 profile, passes/CostModel.cpp = fsdp-sim): GPT-2 124M
   (examples/gpt2.mlir, B=4, T=1024, f32, stage 3, AdamW, max-grad-norm=1)
   at 1, 8 and 64 ranks (8 per node), overlap vs next-step: the step, the
   host stream's time and how long compute waited for it, the host arena.
   Not measured on a GPU.
2. the memory-budget search's choice (offload-next-step=auto, the
   default): a Llama-2-7B-shaped GPT (32 layers, width 4096, ctx 4096,
   vocab 32000, B=1) in bf16 with offload=optimizer under
   memory-budget=80GiB at 1 and 8 ranks, with and without clipping: what
   it chose, its predicted step against the in-step plan's
   (offload-next-step=false), and both host arenas. Predicted only.
3. measured on this machine (CPU device, one rank, --threads 1, so the
   host stream's thread has the second core): a small GPT with clipping,
   without offload, with overlap and with next-step, run alternately
   ROUNDS times; the median step of each run (steps 4 and later), then the
   median over rounds, and the ratios.

  bench/offload_next_step.py [BIN_DIR] [--ranks 1,8,64] [--rounds 3] [--steps 30]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir", nargs="?", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--ranks", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    b = lambda t: os.path.join(a.bindir, t)

    def compile_(model, pipeline, plan):
        subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline={pipeline} plan={plan} report=false"],
                       check=True, capture_output=True, text=True)
        return json.load(open(plan))

    with tempfile.TemporaryDirectory() as tmp:
        print("Predicted, h100 profile: GPT-2 124M f32 B=4 stage 3, offload=optimizer, "
              "max-grad-norm=1.0")
        print("| ranks | joined | step | host updates / compute waited | host arena | ratio |")
        print("|---|---|---|---|---|---|")
        gpt2 = os.path.join(ROOT, "examples", "gpt2.mlir")
        for n in (int(x) for x in a.ranks.split(",")):
            row = {}
            for tag, extra in (("in the step", ""), ("next step", " offload-next-step=true")):
                plan = os.path.join(tmp, f"g{n}-{len(extra)}.plan")
                p = compile_(gpt2, f"optimizer=adamw world-size={n} stage=3 offload=optimizer "
                                   f"max-grad-norm=1.0{extra}", plan)
                out = subprocess.run([sys.executable, b("fsdp-sim"), plan, "--profile", "h100",
                                      "--json"], check=True, capture_output=True,
                                     text=True).stdout
                d = json.loads(out)
                d = d[0] if isinstance(d, list) else d
                row[tag] = d
                ratio = row["in the step"]["step_ms"] / d["step_ms"]
                print(f"| {n} | {tag} | {d['step_ms']:.1f} ms | {d['host_ms']:.1f} / "
                      f"{d['host_exposed_ms']:.2f} ms | {p['host_arena_bytes'] / 2**30:.2f} GiB | "
                      f"{ratio:.2f}x |")

        print()
        print("The search's choice (h100 profile): Llama-2-7B-shaped GPT bf16 B=1 T=4096, "
              "offload=optimizer, memory-budget=80GiB")
        print("| ranks | clipping | chose next-step | step chosen / in-step | ratio | "
              "host arena chosen / in-step |")
        print("|---|---|---|---|---|---|")
        big = os.path.join(tmp, "7b.mlir")
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gen_models.py"), "gpt",
                        "--vocab", "32000", "--ctx", "4096", "--layers", "32", "--heads", "32",
                        "--width", "4096", "--batch", "1", "-o", big], check=True)
        for n in (1, 8):
            for clip in ("1.0", "0"):
                base = (f"optimizer=adamw world-size={n} param-dtype=bf16 memory-budget=80GiB "
                        f"offload=optimizer max-grad-norm={clip}")
                auto = compile_(big, base, os.path.join(tmp, "auto.plan"))
                own = compile_(big, base + " offload-next-step=false",
                               os.path.join(tmp, "own.plan"))
                sa, so = auto["strategy"], own["strategy"]
                print(f"| {n} | {'1.0' if clip != '0' else 'off'} | "
                      f"{'yes' if sa['offload_next_step'] else 'no'} | "
                      f"{sa['predicted_step_s'] * 1e3:.0f} / {so['predicted_step_s'] * 1e3:.0f} ms | "
                      f"{so['predicted_step_s'] / sa['predicted_step_s']:.2f}x | "
                      f"{auto['host_arena_bytes'] / 2**30:.1f} / "
                      f"{own['host_arena_bytes'] / 2**30:.1f} GiB |")

        print()
        print("Measured, this machine (CPU, 1 rank, --threads 1): GPT vocab 512, ctx 32, "
              "4 layers, width 256, batch 1, AdamW, max-grad-norm=1.0, stage 3")
        model = os.path.join(tmp, "g.mlir")
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gen_models.py"), "gpt",
                        "--vocab", "512", "--ctx", "32", "--layers", "4", "--heads", "4",
                        "--width", "256", "--batch", "1", "-o", model], check=True)
        plans = {}
        for tag, extra in (("no offload", ""), ("in the step", " offload=optimizer"),
                           ("next step", " offload=optimizer offload-next-step=true")):
            plans[tag] = os.path.join(tmp, f"m{len(extra)}.plan")
            compile_(model, f"optimizer=adamw world-size=1 stage=3 max-grad-norm=1.0{extra}",
                     plans[tag])
        runs = {tag: [] for tag in plans}
        for _ in range(a.rounds):
            for tag, plan in plans.items():
                out = subprocess.run([b("fsdp-run"), plan, "--steps", str(a.steps), "--json",
                                      "--threads", "1"], check=True, capture_output=True,
                                     text=True).stdout
                ms = [json.loads(l)["ms"] for l in out.splitlines()
                      if l.startswith("{") and '"step"' in l]
                runs[tag].append(statistics.median(ms[3:]))
        med = {tag: statistics.median(v) for tag, v in runs.items()}
        for tag, v in runs.items():
            print(f"  {tag:12s} {med[tag]:7.2f} ms  (rounds: "
                  + ", ".join(f"{x:.2f}" for x in v) + ")")
        print(f"  next step / in the step: {med['in the step'] / med['next step']:.3f}x; "
              f"offload's cost over no offload: {med['in the step'] - med['no offload']:.2f} ms "
              f"-> {med['next step'] - med['no offload']:.2f} ms")


if __name__ == "__main__":
    main()
