#!/usr/bin/python3
"""Step time of fsdp-run against PyTorch (CPU) on the same model and batch.

Same model (examples/gen_models.py), same batch size, same optimizer
(AdamW), same number of threads; both timed over the same steps after a
warm-up. Prints the ratio torch / fsdp-run (> 1: fsdp-run is faster).

  bench/mlp_vs_torch.py BIN_DIR [--threads T] [--steps S] [--hidden H]
                                [--batch B] [--model mlp|gpt]
Run with Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "test", "oracle"))
import torch_ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "m.mlir")
        gen = [sys.executable, os.path.join(HERE, "..", "examples", "gen_models.py")]
        if a.model == "mlp":
            gen += ["mlp", "--hidden", str(a.hidden), "--blocks", str(a.blocks),
                    "--batch", str(a.batch)]
        else:
            gen += ["gpt", "--batch", str(a.batch)]
        subprocess.run(gen + ["-o", model], check=True)
        plan = os.path.join(tmp, "m.plan")
        subprocess.run([os.path.join(a.bindir, "fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline=optimizer=adamw plan={plan} report=false"],
                       check=True)
        out = subprocess.run([os.path.join(a.bindir, "fsdp-run"), plan, "--steps",
                              str(a.steps + a.warmup), "--json", "--threads",
                              str(a.threads), "--lr", "1e-4"],
                             check=True, capture_output=True, text=True).stdout
        rows = [json.loads(l) for l in out.splitlines() if '"step"' in l]
        ours = sorted(r["ms"] for r in rows[a.warmup:])
        ours_ms = ours[len(ours) // 2]

    torch.set_num_threads(a.threads)
    args = argparse.Namespace(model=a.model, hidden=a.hidden, blocks=a.blocks, vocab=256,
                              ctx=32, layers=2, heads=4, width=64)
    net = torch_ref.build(args)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    if a.model == "mlp":
        x = torch.randn(a.batch, a.hidden)
        y = (x.sum(1, keepdim=True) > 0).float()
    else:
        x = torch.randint(0, 256, (a.batch, 32), dtype=torch.int32)
        y = torch.randint(0, 256, (a.batch, 32), dtype=torch.int32)
    times = []
    for i in range(a.steps + a.warmup):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        net.loss(x, y).backward()
        opt.step()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    torch_ms = times[len(times) // 2]
    print(f"model {a.model} (hidden {a.hidden}, blocks {a.blocks}, batch {a.batch}), "
          f"AdamW, {a.threads} thread(s), median of {a.steps} steps after {a.warmup} warm-up")
    print(f"  fsdp-run  {ours_ms:8.3f} ms/step")
    print(f"  pytorch   {torch_ms:8.3f} ms/step  (torch {torch.__version__})")
    print(f"  ratio pytorch / fsdp-run = {torch_ms / ours_ms:.2f}")


if __name__ == "__main__":
    main()
