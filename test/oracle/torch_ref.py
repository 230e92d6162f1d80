#!/usr/bin/python3
"""The PyTorch oracle: replays an fsdp-run training run in PyTorch.

fsdp-run PLAN --dump-dir DIR writes the initial parameters, every batch, the
learning rate of every step and the losses it computed. This script builds
the same model in PyTorch (the structures of examples/gen_models.py, with
the same parameter names), loads the same initial weights, trains on the
same batches with torch.optim (AdamW / SGD with the options recorded in the
plan) and compares the losses step by step and the final parameters.

  torch_ref.py --model mlp|gpt [size options] --plan PLAN --dump-dir DIR
               [--rtol 1e-5] [--param-rtol 1e-4]

Exits 0 when everything is within tolerance, 1 otherwise. Run it with
Debian's /usr/bin/python3 (torch 1.13).
"""
import argparse
import json
import math
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "I32": torch.int32, "I64": torch.int64,
          "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(path):
    """A minimal safetensors reader (the safetensors package is not in Debian)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        t = torch.frombuffer(bytearray(data[base + lo:base + hi]),
                             dtype=DTYPES[meta["dtype"]])
        out[name] = t.reshape(meta["shape"]).clone()
    return out


class MLP(nn.Module):
    """The FSDP2 tutorial MLP (examples/gen_models.py mlp)."""

    def __init__(self, hidden, blocks):
        super().__init__()

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.in_proj = nn.Linear(hidden, hidden)
                self.out_proj = nn.Linear(hidden, hidden)

        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(hidden, 1)

    def loss(self, x, y):
        for b in self.layers:
            x = b.out_proj(F.relu(b.in_proj(x)))
        return F.binary_cross_entropy_with_logits(self.head(x), y)


class GPT(nn.Module):
    """GPT-2 style, pre-LN, tied LM head (examples/gen_models.py gpt)."""

    def __init__(self, vocab, ctx, layers, heads, width):
        super().__init__()
        self.heads = heads
        C = width

        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_attn = nn.Linear(C, 3 * C)
                self.c_proj = nn.Linear(C, C)

        class Mlp(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_fc = nn.Linear(C, 4 * C)
                self.c_proj = nn.Linear(4 * C, C)

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln_1 = nn.LayerNorm(C)
                self.attn = Attn()
                self.ln_2 = nn.LayerNorm(C)
                self.mlp = Mlp()

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, C), wpe=nn.Embedding(ctx, C),
            h=nn.ModuleList(Block() for _ in range(layers)), ln_f=nn.LayerNorm(C)))

    def attention(self, x, attn):
        B, T, C = x.shape
        H, D = self.heads, C // self.heads
        q, k, v = attn.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return attn.c_proj(y)

    def loss(self, ids, targets):
        tr = self.transformer
        x = tr.wte(ids.long()) + tr.wpe.weight
        for b in tr.h:
            x = x + self.attention(b.ln_1(x), b.attn)
            x = x + b.mlp.c_proj(F.gelu(b.mlp.c_fc(b.ln_2(x)), approximate="tanh"))
        logits = tr.ln_f(x) @ tr.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.long().view(-1))


def build(args):
    if args.model == "mlp":
        return MLP(args.hidden, args.blocks)
    return GPT(args.vocab, args.ctx, args.layers, args.heads, args.width)


def load_init(model, init):
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(init))
    extra = sorted(set(init) - set(params))
    if missing or extra:
        sys.exit(f"parameter names differ: missing in the dump {missing}, "
                 f"unknown to the torch model {extra}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(init[name].shape) != tuple(p.shape):
                sys.exit(f"{name}: shape {tuple(init[name].shape)} in the dump, "
                         f"{tuple(p.shape)} in the torch model")
            p.copy_(init[name])


def make_optimizer(model, opts, lr):
    kind = opts.get("optimizer", "adamw")
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr,
                                 betas=(opts["beta1"], opts["beta2"]), eps=opts["eps"],
                                 weight_decay=opts["weight_decay"])
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=opts["momentum"],
                               dampening=opts["dampening"],
                               weight_decay=opts["weight_decay"],
                               nesterov=bool(opts["nesterov"]))
    sys.exit(f"unsupported optimizer '{kind}'")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "gpt"], required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--dump-dir", required=True)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--param-rtol", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with open(args.plan) as f:
        plan = json.load(f)
    with open(f"{args.dump_dir}/log.json") as f:
        log = json.load(f)
    opts = plan["options"]
    inputs = [b["name"] for b in plan["inputs"] if b["role"] == "input"]
    targets = [b["name"] for b in plan["inputs"] if b["role"] == "target"]
    batches = read_safetensors(f"{args.dump_dir}/batches.safetensors")
    model = build(args)
    load_init(model, read_safetensors(f"{args.dump_dir}/init.safetensors"))
    opt = make_optimizer(model, opts, log["lr"][0])

    worst = 0.0
    print(f"{'step':>5} {'fsdp-run':>14} {'pytorch':>14} {'rel diff':>10}")
    for step in range(1, log["steps"] + 1):
        for group in opt.param_groups:
            group["lr"] = log["lr"][step - 1]
        x = batches[f"step{step}.{inputs[0]}"]
        y = batches[f"step{step}.{targets[0]}"]
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        if opts.get("max_grad_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts["max_grad_norm"])
        opt.step()
        ours = log["losses"][step - 1]
        rel = abs(ours - loss.item()) / max(abs(loss.item()), 1e-12)
        worst = max(worst, rel)
        print(f"{step:>5} {ours:>14.8f} {loss.item():>14.8f} {rel:>10.2e}")

    final = read_safetensors(f"{args.dump_dir}/final.safetensors")
    worst_param, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        ref = p.detach()
        diff = (final[name] - ref).abs().max().item()
        scale = max(ref.abs().max().item(), 1e-12)
        if diff / scale > worst_param:
            worst_param, worst_name = diff / scale, name
    ok = worst <= args.rtol and worst_param <= args.param_rtol
    print(f"max relative loss difference {worst:.3e} (tolerance {args.rtol:g}); "
          f"max parameter difference {worst_param:.3e} of the tensor's max "
          f"(tolerance {args.param_rtol:g}; worst: {worst_name})")
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
