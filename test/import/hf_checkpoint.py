#!/usr/bin/python3
"""A "pretrained" checkpoint in Hugging Face's format for an fsdp-import
script's model, and the bitwise check of a run that started from it.

  hf_checkpoint.py write SCRIPT DIR F32 [--seed N] [--shards 2]
  hf_checkpoint.py compare INIT F32

write: builds SCRIPT's model() (the module fsdp-import imports), moves its
parameters away from model()'s own initial values (seeded: a matrix
+ 0.02 * N(0,1), a vector of ones 1 + 0.1 * N(0,1), so every tensor is
unlike the default init and none is exactly representable by chance), and
writes the state_dict() parameters in BF16 as a sharded Hugging Face
checkpoint in DIR: model-0000K-of-0000N.safetensors (in state_dict()
order, cut where the bytes pass 1/N of the total, as HF's max_shard_size
does) + model.safetensors.index.json ({"metadata": {"total_size"},
"weight_map"}). F32 gets the same values widened back to float32 (torch's
t.to(bfloat16).float(), i.e. what load_state_dict copies into an f32
module): the values a fine-tune from DIR starts from.

compare: INIT (fsdp-run --dump-dir's init.safetensors) against F32, every
tensor bit for bit (names, shapes, bytes).

The safetensors layout by hand (the safetensors package is not in
Debian): 8-byte little-endian header length, the JSON header {name:
{dtype, shape, data_offsets}}, the raw little-endian bytes; bf16 through
an int16 view (numpy has no bfloat16). Plain torch 1.13.
"""
import argparse
import importlib.util
import json
import os
import struct
import sys

import torch

# The safetensors writer the --init-from test uses (test/e2e/init_from.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from init_from import write_safetensors as _write  # noqa: E402


def write_safetensors(path, tensors):
    _write(path, tensors, metadata={"format": "pt"})


def read_raw(path):
    """name -> (dtype, shape, bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return {name: (m["dtype"], m["shape"], data[8 + n + m["data_offsets"][0]:
                                                8 + n + m["data_offsets"][1]])
            for name, m in header.items() if name != "__metadata__"}


def write(args):
    spec = importlib.util.spec_from_file_location("fsdp_import_user_model", args.script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.model()
    params = {n for n, _ in model.named_parameters()}
    state = {n: t for n, t in model.state_dict().items() if n in params}
    torch.manual_seed(args.seed)
    pretrained = {}
    for name, t in state.items():
        if t.dim() >= 2:
            pretrained[name] = t + 0.02 * torch.randn(t.shape)
        else:
            pretrained[name] = t + 0.1 * torch.randn(t.shape)
    bf16 = {n: t.to(torch.bfloat16) for n, t in pretrained.items()}

    os.makedirs(args.dir, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in bf16.values())
    files = [f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors" for i in range(args.shards)]
    parts, weight_map, done = [dict() for _ in files], {}, 0
    for name, t in bf16.items():
        k = min(done * args.shards // total, args.shards - 1)
        parts[k][name] = t
        weight_map[name] = files[k]
        done += t.numel() * t.element_size()
    if any(not p for p in parts):
        sys.exit("a shard would be empty: fewer shards")
    for f, part in zip(files, parts):
        write_safetensors(os.path.join(args.dir, f), part)
    with open(os.path.join(args.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    write_safetensors(args.f32, {n: t.float() for n, t in bf16.items()})
    differ = sum(not torch.equal(t.float(), state[n]) for n, t in bf16.items())
    print(f"wrote {len(bf16)} BF16 parameters ({total} bytes) in "
          f"{' + '.join(str(len(p)) for p in parts)} tensors over {args.shards} shards; "
          f"{differ} of {len(bf16)} differ from model()'s initial values")
    return 0


def compare(args):
    a, b = read_raw(args.init), read_raw(args.f32)
    bad = sorted(set(a) ^ set(b))
    bad += [n for n in sorted(set(a) & set(b)) if a[n] != b[n]]
    if bad:
        print(f"initial parameters are NOT the checkpoint's bf16 values: {len(bad)} "
              f"tensors differ or are missing, e.g. {bad[:3]}")
        return 1
    print(f"initial parameters are the checkpoint's bf16 values bit for bit ({len(a)} tensors)")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("script")
    w.add_argument("dir")
    w.add_argument("f32")
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--shards", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("init")
    c.add_argument("f32")
    args = ap.parse_args()
    return write(args) if args.cmd == "write" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
