#!/usr/bin/env python3
"""fsdp-run --init-from a Hugging Face-style checkpoint, lazily read.

usage: init_from.py BIN_DIR WORK_DIR   (run with a python that has torch)

For a small MLP and a small GPT (units whose sizes are not multiples of 3,
so 3 ranks' ZeRO-3 slices cut tensors): the model's initial parameters
(fsdp-run --dump-dir, f32) are written as a sharded bf16 checkpoint (3
shard files + model.safetensors.index.json, by hand: the safetensors
layout, torch only for the bf16 rounding), and as single F16 and F64
files. fsdp-run --init-from the index and the directory, at 1 rank and at
3 ranks (stage 3), must start from torch's conversion bit for bit (the
dumped init.safetensors), and train exactly as --init-from an f32 file
holding those values: bitwise at 1 rank and with the same plan at 3
ranks; 3 ranks within 1e-6 (relative, shard_equivalence.py's bound) of 1
rank. Then host memory: a 3-rank run --init-from an F64 file six times
its rank's parameter slice must peak (RSS, the largest rank) no higher
than 32 MiB above the same run without --init-from; reading the file
whole, as the reader once did, costs every rank at least the file again.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")
GLOBAL_BATCH = 12
STEPS = 3
failures = 0


def report(ok, what):
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)


def sh(args, check=True):
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(args)}\n{r.stderr}")
    return r


# --- safetensors by hand -------------------------------------------------

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64"}


def raw_bytes(t):
    """Little-endian bytes of a tensor (bf16 through an int16 view: numpy
    has no bfloat16)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def write_safetensors(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        b = raw_bytes(t)
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def read_f32(path):
    """name -> (shape, f32 bytes) of an F32-only file (fsdp-run's dumps)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        lo, hi = meta["data_offsets"]
        out[name] = (meta["shape"], data[8 + n + lo:8 + n + hi])
    return out


def as_torch(tensors):
    return {k: torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(s)
            for k, (s, b) in tensors.items()}


def write_hf_sharded(directory, tensors, shards):
    """A Hugging Face sharded checkpoint: tensors dealt round-robin (so
    every shard holds pieces of several units) into `shards` files."""
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map, parts = {}, [dict() for _ in files]
    for i, name in enumerate(names):
        parts[i % shards][name] = tensors[name]
        weight_map[name] = files[i % shards]
    for f, part in zip(files, parts):
        write_safetensors(os.path.join(directory, f), part, {"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return index


# --- the runs ------------------------------------------------------------

def main():
    bindir, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    opt, run = os.path.join(bindir, "fsdp-opt"), os.path.join(bindir, "fsdp-run")

    def plan(kind, args, batch, n, stage, tag):
        mlir = os.path.join(work, f"{tag}.mlir")
        sh([sys.executable, GEN, kind] + args + ["--batch", str(batch), "-o", mlir])
        path = os.path.join(work, tag + ".plan")
        sh([opt, mlir, "-o", os.devnull, f"--fsdp-pipeline=optimizer=adamw world-size={n} "
            f"stage={stage} plan={path} report=false"])
        return path

    def train(p, n, init=None, dump=None, steps=STEPS, check=True):
        args = [run, p, "--threads", "1", "--lr", "1e-2", "--json", "--steps", str(steps)]
        if n > 1:
            args += ["--nproc", str(n)]
        if init:
            args += ["--init-from", init]
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
            args += ["--dump-dir", dump]
        r = sh(args, check=check)
        losses = [json.loads(l)["loss"] for l in r.stdout.splitlines()
                  if l.startswith("{") and "step" in json.loads(l)]
        return r, losses

    models = {
        "mlp": ("mlp", ["--hidden", "16", "--blocks", "2"]),
        "gpt": ("gpt", ["--vocab", "64", "--ctx", "8", "--layers", "2", "--heads", "2",
                        "--width", "16"]),
    }
    for name, (kind, args) in models.items():
        p1 = plan(kind, args, GLOBAL_BATCH, 1, 0, f"{name}1")
        p3 = plan(kind, args, GLOBAL_BATCH // 3, 3, 3, f"{name}3")
        units = [u["flat_numel"] for u in json.load(open(p3))["units"]]
        report(any(u % 3 for u in units),
               f"{name}: unit sizes {units} (some not a multiple of 3: slices cut tensors)")
        d0 = os.path.join(work, f"{name}.d0")
        train(p1, 1, dump=d0, steps=1)
        f32 = as_torch(read_f32(os.path.join(d0, "init.safetensors")))

        # torch's conversions: what load_state_dict's param.copy_ gives.
        bf16 = {k: v.to(torch.bfloat16) for k, v in f32.items()}
        f16 = {k: v.to(torch.float16) for k, v in f32.items()}
        # F64 values between f32 neighbours, so the rounding is exercised.
        gen = torch.Generator().manual_seed(7)
        f64 = {k: v.double() * (1 + 1e-7 * torch.randn(v.shape, generator=gen,
                                                         dtype=torch.float64))
               for k, v in f32.items()}
        hf = os.path.join(work, f"{name}.hf")
        index = write_hf_sharded(hf, bf16, 3)
        cases = {
            "bf16 index": (index, bf16),
            "bf16 directory": (hf, bf16),
        }
        for label, src in (("f16", f16), ("f64", f64)):
            path = os.path.join(work, f"{name}.{label}.safetensors")
            write_safetensors(path, src)
            cases[f"{label} file"] = (path, src)

        for label, (path, src) in cases.items():
            widened = {k: v.to(torch.float32) for k, v in src.items()}
            ref_file = os.path.join(work, f"{name}.{label.replace(' ', '_')}.f32.safetensors")
            write_safetensors(ref_file, widened)
            expect = {k: (list(v.shape), raw_bytes(v)) for k, v in widened.items()}
            _, ref1 = train(p1, 1, init=ref_file)
            _, ref3 = train(p3, 3, init=ref_file)
            for n, p, ref in ((1, p1, ref1), (3, p3, ref3)):
                dump = os.path.join(work, f"{name}.{label.replace(' ', '_')}.n{n}")
                _, losses = train(p, n, init=path, dump=dump)
                got = read_f32(os.path.join(dump, "init.safetensors"))
                bad = [k for k in expect if got.get(k) != expect[k]]
                report(not bad and len(got) == len(expect),
                       f"{name} {label} N={n}: the initial parameters are torch's "
                       f"conversion bit for bit ({len(expect)} tensors"
                       + (f"; differ: {bad[:3]})" if bad else ")"))
                report(losses == ref and len(losses) == STEPS,
                       f"{name} {label} N={n}: losses equal --init-from the f32 values "
                       f"bitwise ({losses})")
            rel = max(abs(a - b) / abs(b) for a, b in zip(ref3, ref1))
            report(rel <= 1e-6, f"{name} {label}: N=3 losses within 1e-6 of N=1 "
                   f"(max rel diff {rel:.2e})")

    # --- host memory: a checkpoint far larger than a rank's slice --------
    # MLP of 4 blocks of 1024 x 1024 (8.4M parameters, 34 MB in f32): a
    # 3-rank ZeRO-3 rank stores 11 MB of them; the F64 file is 67 MB.
    pbig = plan("mlp", ["--hidden", "1024", "--blocks", "4"], 3, 3, 3, "big3")
    # The parameters' values do not matter here.
    params = json.load(open(pbig))["params"]
    gen = torch.Generator().manual_seed(1)
    big = {p["name"]: 0.02 * torch.randn(p["shape"], generator=gen, dtype=torch.float64)
           for p in params}
    numel = sum(t.numel() for t in big.values())
    path = os.path.join(work, "big.f64.safetensors")
    write_safetensors(path, big)
    size = os.path.getsize(path)

    def peak_rss(extra):
        # A fresh python per measurement: RUSAGE_CHILDREN's ru_maxrss is the
        # largest of its waited-for descendants (the launcher and every rank).
        code = ("import resource, subprocess, sys\n"
                "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
                "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        r = sh([sys.executable, "-c", code, run, pbig, "--threads", "1", "--steps", "1",
                "--nproc", "3", "--quiet"] + extra)
        rc, kib = r.stdout.split()
        return int(rc), int(kib) * 1024

    rc0, base = peak_rss([])
    rc1, loaded = peak_rss(["--init-from", path])
    slice_bytes = 4 * numel // 3
    report(rc0 == 0 and rc1 == 0 and size >= 5 * slice_bytes,
           f"memory: F64 file of {size >> 20} MiB, {size / slice_bytes:.1f}x a rank's "
           f"{slice_bytes >> 20} MiB parameter slice; runs exit {rc0}, {rc1}")
    grown = loaded - base
    report(grown <= 32 << 20,
           f"memory: peak RSS of the largest rank {base >> 20} MiB without --init-from, "
           f"{loaded >> 20} MiB with it (+{grown / 2**20:.1f} MiB; the bound is 32 MiB, "
           f"the file {size >> 20} MiB)")

    print("all init-from checks passed" if not failures else f"FAIL: {failures} check(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
