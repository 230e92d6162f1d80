#!/usr/bin/env python3
"""The FSDP2 tutorial MLP at hidden 4096 on one GPU: fsdp-run against PyTorch.

The model of examples/gen_models.py mlp (blocks of Linear(H, H) -> ReLU ->
Linear(H, H), a Linear(H, 1) head, BCE with logits; test/oracle/torch_ref.py
builds the same module), AdamW, the same batch of rows. Runs:
  - fsdp-run --device cuda on plans compiled elsewhere (scripts/gpu-pack.sh:
    mlp_{bf16,f32}_h{H}_b{B}.plan), timed by fsdp-run (--json: mean_step_ms
    over steps 2..);
  - PyTorch: fp32 eager (TF32 off), bf16 autocast eager, bf16 autocast +
    torch.compile, FSDP2 fully_shard at world size 1 (bf16 parameters,
    MixedPrecisionPolicy) + torch.compile;
and prints rows/s, TFLOP/s (6 x parameters x rows per step), MFU against
989 TFLOP/s (H100 dense bf16), peak memory and the ratio fsdp-run bf16 /
each run.

  python3 bench/mlp_gpu.py --fsdp-run gpu-kit/bin/fsdp-run --plans gpu-kit/plans \\
      [--hidden 4096 --blocks 8 --batch 1024 --steps 20] [--skip-torch] [--json out.json]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_gpu import PEAK_FLOPS, TORCH_MODE_NAMES, run_fsdp, time_torch_mode  # noqa: E402


def report(name, ms, a, params, peak, base=None):
    rows_s = a.batch / (ms / 1000)
    tflops = 6 * params * a.batch / (ms / 1000) / 1e12
    line = {"system": name, "batch": a.batch, "ms_per_step": round(ms, 3),
            "rows_per_s": round(rows_s), "tflops": round(tflops, 1),
            "mfu": round(tflops * 1e12 / PEAK_FLOPS, 4),
            "peak_gib": round(peak / 2**30, 2) if peak else None}
    if base:
        line["fsdp_bf16_over_this"] = round(base / rows_s, 3)
    print(f"{name:36s} {ms:8.3f} ms/step {rows_s:10.0f} rows/s {tflops:7.1f} TFLOP/s"
          f"  MFU {100 * line['mfu']:5.1f}%  peak {line['peak_gib']} GiB"
          + (f"  fsdp bf16 / this = {line['fsdp_bf16_over_this']}" if base else ""), flush=True)
    return line


def torch_runs(a, modes):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.in_proj = nn.Linear(a.hidden, a.hidden)
            self.out_proj = nn.Linear(a.hidden, a.hidden)

        def forward(self, x):
            return self.out_proj(F.relu(self.in_proj(x)))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(a.blocks))
            self.head = nn.Linear(a.hidden, 1)

        def forward(self, x, y):
            for b in self.layers:
                x = b(x)
            return F.binary_cross_entropy_with_logits(self.head(x).float(), y)

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = []
    for mode in modes:
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = MLP().to(dev)
        params = sum(p.numel() for p in model.parameters())
        x = torch.randn(a.batch, a.hidden, device=dev)
        y = (x.sum(1, keepdim=True) > 0).float()
        ms = time_torch_mode(model, model.layers, mode, (x, y), a.steps, port="29519")
        out.append((TORCH_MODE_NAMES[mode].replace("bf16 eager (SDPA)", "bf16 autocast eager"),
                    ms, params, torch.cuda.max_memory_allocated()))
        del model
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fsdp-run", default="gpu-kit/bin/fsdp-run")
    ap.add_argument("--plans", default="gpu-kit/plans")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--torch-modes", default="fp32,eager,compile,fsdp2")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    params = a.blocks * 2 * (a.hidden * a.hidden + a.hidden) + a.hidden + 1
    rows, base = [], None
    for dtype in ("bf16", "f32"):
        plan = os.path.join(a.plans, f"mlp_{dtype}_h{a.hidden}_b{a.batch}.plan")
        if not os.path.exists(plan):
            print(f"(no {plan}: skipped)")
            continue
        try:
            ms, peak, _ = run_fsdp(a.fsdp_run, plan, a.steps, "")
        except RuntimeError as e:
            print(f"fsdp-run {dtype}: {e}", file=sys.stderr)
            continue
        line = report(f"fsdp-run {dtype}", ms, a, params, peak, base)
        if dtype == "bf16":
            base = line["rows_per_s"]
        rows.append(line)
    if not a.skip_torch:
        for name, ms, p, peak in torch_runs(a, a.torch_modes.split(",")):
            assert p == params, (p, params)
            rows.append(report(name, ms, a, params, peak, base))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hidden": a.hidden, "blocks": a.blocks, "batch": a.batch,
                       "params": params, "peak_flops": PEAK_FLOPS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
