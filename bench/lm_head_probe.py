#!/usr/bin/env python3
"""The three GEMMs of GPT-2's tied LM head at B x T = 16384 tokens, bf16,
timed through PyTorch (cuBLAS) with CUDA events on random data: what the
library reaches for these shapes (50257 columns: rows not 16-byte
aligned), beside fsdp-run's own per-instruction profile (--trace).
  python3 bench/lm_head_probe.py [--tokens 16384]"""
import argparse

import torch

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--tokens", type=int, default=16384)
a = ap.parse_args()
C, N = 768, a.tokens
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
h = torch.randn(N, C, device=dev, dtype=torch.bfloat16, generator=g)
# GPT-2's 50257 columns, and 50304 (fsdp-pad-classes' and llm.c's padding).
for V in (50257, 50304):
    w = torch.randn(V, C, device=dev, dtype=torch.bfloat16, generator=g)
    dl = torch.randn(N, V, device=dev, dtype=torch.bfloat16, generator=g)
    cases = {
        "logits = h w^T  [N,768]x[768,V]": lambda: h @ w.t(),
        "dh = dlogits w  [N,V]x[V,768]": lambda: dl @ w,
        "dw = dlogits^T h [V,N]x[N,768]": lambda: dl.t() @ h,
    }
    flops = 2 * N * V * C
    for name, f in cases.items():
        for _ in range(3):
            f()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            f()
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / 10
        print(f"V={V} {name:36s} {ms:7.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
    del w, dl
