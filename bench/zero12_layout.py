#!/usr/bin/env python3
"""Memory of ZeRO stages 1/2/3 with f32 and bf16 parameters, from the plan.

GPT-2 124M (examples/gpt2.mlir, batch 4 x 1024 per rank), AdamW, N ranks
(default 8); prints per-rank parameters, optimizer state, gradients,
gathered parameters ("comm") and the planned peak, in GiB.

  bench/zero12_layout.py [BIN_DIR] [--ranks 8]
"""
import argparse
import json
import os
import subprocess
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir", nargs="?", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--ranks", type=int, default=8)
    a = ap.parse_args()
    gib = lambda x: x / 2**30
    with tempfile.TemporaryDirectory() as tmp:
        plan = os.path.join(tmp, "p.plan")
        for cfg in ("stage=1", "stage=2", "stage=3 reshard-after-forward=false", "stage=3"):
            for pd in ("f32", "bf16"):
                subprocess.run([os.path.join(a.bindir, "fsdp-opt"),
                                os.path.join(ROOT, "examples", "gpt2.mlir"), "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer=adamw world-size={a.ranks} {cfg} "
                                f"param-dtype={pd} plan={plan} report=false"], check=True)
                m = json.load(open(plan))["memory"]
                print(f"{cfg:<36} {pd:<5} params {gib(m['params']):.3f} state "
                      f"{gib(m['state']):.3f} grads {gib(m['grads']):.3f} comm "
                      f"{gib(m['comm']):.3f} peak {gib(m['peak']):.3f} GiB")


if __name__ == "__main__":
    main()
