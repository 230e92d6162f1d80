#!/usr/bin/env python3
"""GPT-2 124M (T=1024, tied head) on one GPU: fsdp-run against PyTorch.

Runs, on the same model shape and batch, one after the other:
  - fsdp-run --device cuda on plans compiled elsewhere (scripts/gpu-pack.sh:
    examples/gen_models.py gpt at GPT-2 small, param-dtype=bf16 and f32),
    timed by fsdp-run itself (--json summary: mean_step_ms over steps 2..);
  - PyTorch (the machine's torch, e.g. /opt/torch/.venv/bin/python3):
    bf16 autocast eager with SDPA, bf16 autocast + torch.compile, and FSDP2
    fully_shard at world size 1 with bf16 parameters (MixedPrecisionPolicy)
    + torch.compile;
and prints tok/s, MFU (6N + 6 L C T flops per token against 989 TFLOP/s
dense bf16 on an H100), peak memory and each run's ratio to fsdp-run bf16.

fsdp-run's memory is its arena plus the runtime scratch outside it (both
planned, reported by fsdp-run); PyTorch's is torch.cuda.max_memory_allocated.

  python3 bench/gpt2_gpu.py --fsdp-run gpu-kit/bin/fsdp-run --plans gpu-kit/plans \
      --batch 16 --steps 20 [--skip-torch] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys
import time

V, T, L, H, C = 50257, 1024, 12, 12, 768
N_PARAMS = 124_439_808  # GPT-2 small with tied head (wpe included)
PEAK_FLOPS = 989e12     # H100 SXM dense bf16


def flops_per_token():
    return 6 * N_PARAMS + 6 * L * C * T


def report(name, ms, batch, peak_bytes, base_tps=None):
    tps = batch * T / (ms / 1000)
    mfu = tps * flops_per_token() / PEAK_FLOPS
    line = {"system": name, "batch": batch, "ms_per_step": round(ms, 2),
            "tok_per_s": round(tps), "mfu": round(mfu, 4),
            "peak_gib": round(peak_bytes / 2**30, 2) if peak_bytes else None}
    if base_tps:
        line["fsdp_bf16_over_this"] = round(base_tps / tps, 3)
    print(f"{name:34s} B={batch:3d} {ms:9.2f} ms/step {tps:10.0f} tok/s  MFU {100 * mfu:5.1f}%"
          f"  peak {line['peak_gib']} GiB"
          + (f"  fsdp bf16 / this = {line['fsdp_bf16_over_this']}" if base_tps else ""),
          flush=True)
    return line


def run_fsdp(binary, plan, steps, data, extra=()):
    cmd = [binary, plan, "--device", "cuda", "--steps", str(steps), "--lr", "1e-4",
           "--json"] + list(extra)
    if data:
        cmd += ["--data", data]
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
        raise RuntimeError(f"fsdp-run failed (rc {out.returncode})")
    summary = None
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and '"summary"' in line:
            summary = json.loads(line)
    if summary is None:
        raise RuntimeError("fsdp-run printed no --json summary:\n" + out.stdout[-2000:])
    if "device" in summary:  # the GPU and the cuBLASLt / NCCL files it ran with
        print(f"  device {summary['device']} | comm {summary.get('comm')}", flush=True)
    peak = summary["predicted_peak"] + summary.get("scratch_outside_arena", 0)
    return summary["mean_step_ms"], peak, summary


def torch_runs(batch, steps, modes):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B_, T_, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B_, T_, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B_, T_, C))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.lnf = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = F.linear(self.lnf(x), self.wte.weight)  # tied head
            return F.cross_entropy(logits.view(-1, V).float(), targets.view(-1))

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (issue 9's anchor)
    torch.backends.cudnn.allow_tf32 = False
    results = []
    for mode in modes:
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = GPT().to(dev)
        assert sum(p.numel() for p in model.parameters()) == N_PARAMS
        idx = torch.randint(0, V, (batch, T), device=dev)
        tgt = torch.randint(0, V, (batch, T), device=dev)
        ms = time_torch_mode(model, model.blocks, mode, (idx, tgt), steps, weight_decay=0.1)
        results.append((TORCH_MODE_NAMES[mode], ms, torch.cuda.max_memory_allocated()))
        del model
    return results


TORCH_MODE_NAMES = {"fp32": "pytorch fp32 eager (TF32 off)", "eager": "pytorch bf16 eager (SDPA)",
                    "compile": "pytorch bf16 + compile",
                    "fsdp2": "pytorch FSDP2 world 1 bf16 + compile"}


def time_torch_mode(model, blocks, mode, inputs, steps, port="29517", **adamw):
    """ms per training step of `model(*inputs)` (a loss) under `mode`: fp32
    eager, bf16 autocast eager, bf16 autocast + torch.compile, or FSDP2
    fully_shard at world size 1 (each of `blocks`, then the root; bf16
    parameters, f32 reduction) + torch.compile; fused AdamW (lr 1e-4,
    `adamw`), 3 warm-up steps, then the mean over `steps`."""
    import torch
    step_model = model
    if mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", port)
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=0, world_size=1)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    if mode in ("compile", "fsdp2"):
        step_model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, **adamw)

    def step():
        if mode in ("fsdp2", "fp32"):
            loss = step_model(*inputs)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fsdp-run", default="gpu-kit/bin/fsdp-run")
    ap.add_argument("--plans", default="gpu-kit/plans",
                    help="folder with gpt2_bf16_b{B}.plan and gpt2_f32_b{B}.plan")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--data", default="", help="token file for fsdp-run (default synthetic)")
    ap.add_argument("--torch-modes", default="eager,compile,fsdp2",
                    help="comma-separated: fp32, eager, compile, fsdp2")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    base = None
    for dtype in ("bf16", "f32"):
        plan = os.path.join(a.plans, f"gpt2_{dtype}_b{a.batch}.plan")
        if not os.path.exists(plan):
            print(f"(no {plan}: skipped)")
            continue
        try:
            ms, peak, _ = run_fsdp(a.fsdp_run, plan, a.steps, a.data)
        except RuntimeError as e:
            print(f"fsdp-run {dtype}: {e}", file=sys.stderr)
            continue
        line = report(f"fsdp-run {dtype}", ms, a.batch, peak, base)
        if dtype == "bf16":
            base = line["tok_per_s"]
        rows.append(line)
        if dtype == "bf16":
            # The same plan with the step captured as a CUDA graph from step
            # 2 on (its mean over steps 2.. includes the capture step).
            try:
                ms, peak, _ = run_fsdp(a.fsdp_run, plan, a.steps, a.data, ["--cuda-graphs"])
                rows.append(report("fsdp-run bf16 + CUDA graph", ms, a.batch, peak, base))
            except RuntimeError as e:
                print(f"fsdp-run bf16 --cuda-graphs: {e}", file=sys.stderr)
    if not a.skip_torch:
        for name, ms, peak in torch_runs(a.batch, a.steps, a.torch_modes.split(",")):
            rows.append(report(name, ms, a.batch, peak, base))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"batch": a.batch, "T": T, "flops_per_token": flops_per_token(),
                       "peak_flops": PEAK_FLOPS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
