#!/usr/bin/env python3
"""AdamW's moments (and SGD's momentum buffer, LAMB's moments) in 8-bit block codes
(optimizer-state-dtype=8bit) end to end.

usage: optimizer_state_8bit.py BIN_DIR shards            (a) N ranks == 1 rank, memory, offload, resume
       optimizer_state_8bit.py BIN_DIR sgd               (d) SGD's 8-bit momentum buffer, the same
       optimizer_state_8bit.py BIN_DIR lamb              (e) LAMB's 8-bit moments, the same
       optimizer_state_8bit.py BIN_DIR text TOKENS.bin   (b) 200 steps: f32 and 8-bit moments
       optimizer_state_8bit.py BIN_DIR cuda RUN_BINARY   (c) --device cuda against the CPU

What the option changes: the f32 master parameters stay; each of AdamW's two
moments is one packed byte vector a unit shard, a code an element (exp_avg a
sign and E4M3, exp_avg_sq's square root E4M4, relative to their block's
largest magnitude) and an f32 scale a block of 256 (runtime/core/Moments8.h):
about 2 bytes of optimizer state a parameter instead of 8. Each update decodes
a block, runs AdamW in f32 (the parameter's update reads the f32 moments) and
encodes the new moments to the nearest code. fsdp-shard pads every trainable
unit to whole blocks per shard, so every layout has the one-rank blocks.

(a) The small GPT, global batch 4, f32 compute, lr 1e-2:
    - two one-rank runs are bitwise equal; steps 1-2 are bitwise the f32
      moments' run (step 1 reads zero moments, which decode exactly, and the
      parameters' update reads the f32 moments), steps 3-10 differ from it
      and stay within EIGHT of it (a sanity bound: it catches a broken
      decode or update, which moves the loss by whole units; measured in
      the output);
    - N = 2 at stages 1, 2 and 3 (and stage 1 with two micro-batches) are
      bitwise N = 2 at stage 0 (and its two micro-batches) for all STEPS,
      as with f32 moments: the same gradients, and every layout's blocks
      the unit's, so the same codes (blocks cut elsewhere change codes from
      step 3 on). Against one rank and for HSDP 2x2, whose gradients differ
      in their last bits (sums in another order), within EIGHT: a last bit
      can move a moment by a code step (check_shards says more);
    - every state buffer is shapes::quantizedBytes of its shard in blocks of
      256, the optimizer state is that sum (about 0.254 of the f32 plan's),
      the units are padded to whole blocks per shard, and the arena
      measured equals the planned one;
    - the ZeRO-3 run offloaded (the update on the host), joined in the
      next step, and with its state on disk is bitwise the in-memory run;
    - a 2-rank ZeRO-3 checkpoint resumes bitwise; stage 2 with f32
      moments loads it decoded (steps 4-5 bitwise the 8-bit run: they read
      the parameters and the decoded moments; step 6 not) and says so;
      one rank with 8-bit moments loads it exactly (codes and scales copied:
      step 4 bitwise; fsdp-ckpt reshard to one rank and back gives every
      byte); a 2-rank f32-moment checkpoint, and the 8-bit one into blocks
      of 128, load encoded: every code and scale of fsdp-ckpt reshard's
      output is the format's nearest code (check_encoded, an independent
      encoder), resuming from that output is bitwise resuming from the
      source, step 4 is bitwise the source run's, the conversion is said.
(b) 200 steps on text tokens (as optimizer_state_bf16.py's (b)): the 8-bit
    run's 50-step window means within 2% of the f32 moments' (a sanity
    bound; the distances are printed for docs/BENCHMARKS.md), and it learns.
(c) --device cuda (the CUDA emulator here, a GPU where there is one) against
    the CPU device on the same plan: step 1 within 1e-6, 6 steps within
    EIGHT (check_cuda says why not 1e-4 as bf16's; the 8-bit update is
    DeviceConformance-tested bitwise), and --cuda-graphs bitwise eager.
(d) SGD with momentum 0.9 (Nesterov), its buffer coded as exp_avg (a sign
    and E4M3; about 1 byte of state a parameter instead of 4), lr 0.05:
    - steps 1-2 bitwise the f32 buffer's run (step 1 clones the gradient
      into the buffer, which the parameters' update reads in f32; step 2
      computes with those parameters), the rest within EIGHT;
    - N=2 at stages 1, 2 and 3 bitwise N=2 at stage 0 (every layout's
      blocks the unit's), one rank within EIGHT;
    - each buffer its shard's codes and scales, the state about a quarter
      of the f32 plan's, the arena measured as planned;
    - the ZeRO-3 run offloaded, joined in the next step and on NVMe
      bitwise the in-memory run (as (a));
    - a 2-rank ZeRO-3 checkpoint resumes bitwise; stage 2 with an f32
      buffer loads it decoded (steps 4-5 bitwise, the conversion said); an
      f32-buffer checkpoint loads encoded into the 8-bit plan (every code
      and scale of fsdp-ckpt reshard's output the nearest: check_encoded;
      resuming from it bitwise resuming from the source).
(e) LAMB (its norms read the decoded moments; each parameter's trust ratio
    and step see the f32 step's direction), lr 0.02:
    - steps 1-2 bitwise the f32 moments' run (as (a)), the rest within
      EIGHT;
    - N=2 at stages 2 and 3 bitwise stage 1 (the same shards, so each
      rank's partial norms and their all-reduce in the same order); stage
      0 (whole units: the norms summed in another order) and one rank
      within EIGHT;
    - each moment its shard's codes and scales, the state about a quarter
      of the f32 plan's, the arena measured as planned;
    - the ZeRO-3 run offloaded, joined in the next step and on NVMe
      bitwise the in-memory run (as (a));
    - a 2-rank ZeRO-3 checkpoint resumes bitwise; stage 2 with f32 moments
      loads it decoded (steps 4-5 bitwise, the conversion said); an
      f32-moment checkpoint loads encoded (check_encoded, as (d)).
    The update's bytes are DeviceConformance's and KernelsTest's (bitwise
    the f32 update on the decoded moments, encoded once), its arithmetic
    PyTorch's in float64 (torch-oracle-8bit-lamb.test).
(f) AdamW's moments in 4-bit codes (optimizer-state-dtype=4bit, blocks of
    128, runtime/core/Moments4.h), lr 1e-2:
    - steps 1-2 bitwise the f32 moments' run (as (a)), the rest within
      FOUR; N=2 at stages 1-3 bitwise stage 0, one rank within EIGHT;
    - each moment its shard's codes (two a byte) and scales, the state
      under 0.14 of the f32 plan's, the arena measured as planned;
    - offloaded, next-step and NVMe runs bitwise in memory;
    - a 2-rank ZeRO-3 checkpoint resumes bitwise; stage 2 with f32
      moments loads it decoded (steps 4-5 bitwise); an f32-moment
      checkpoint loads encoded (resuming from fsdp-ckpt reshard's output
      bitwise resuming from the source, step 4 the f32 run's); an 8-bit
      checkpoint of the same layout loads converted, by name.
    The bytes are KernelsTest's (the codec against a search; the update
    bitwise the f32 update on the decoded moments, encoded once) and
    DeviceConformance's (CPU and the CUDA emulator).
"""
import bisect
import json
import math
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mixed_precision as mp  # noqa: E402
from e2e_lib import cuda_runs, main_modes  # noqa: E402
from optimizer_state_bf16 import gpt, rel  # noqa: E402

GLOBAL_BATCH = 4
STEPS = 10
BLOCK = 256
BLOCK4 = 128  # state-dtype=4bit's default block (torchao's)
EIGHT = 0.05  # 8-bit vs f32 moments over 10 steps: a sanity bound (measured ~1e-3)
# 4-bit vs f32 moments: a sanity bound. At lr 1e-2 the small GPT's
# per-batch losses part within a few steps whatever the moments (measured
# 9e-2 at worst, both ways: 4-bit lower at step 6, higher at step 8); how
# closely 4-bit tracks f32 is the 200-step text measurement's question.
FOUR = 0.2
LR = ["--lr", "1e-2"]
EIGHT_OPT = "optimizer-state-dtype=8bit"


def quantized_bytes(n, block):
    return (n + 3) // 4 * 4 + 4 * ((n + block - 1) // block)


def packed4_bytes(n, block):
    """A 4-bit moment shard's bytes (shapes::packedStateBytes(n, block, 4))."""
    return ((n + 1) // 2 + 3) // 4 * 4 + 4 * ((n + block - 1) // block)


def tensors(ckpt):
    """Every rank file's tensors (name -> bytes) of a checkpoint's newest step."""
    step = sorted(d for d in os.listdir(ckpt) if d.startswith("step-"))[-1]
    out = {}
    for f in sorted(os.listdir(os.path.join(ckpt, step))):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(ckpt, step, f), "rb") as fh:
            raw = fh.read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, t in header.items():
            if name != "__metadata__":
                a, b = t["data_offsets"]
                out[f + ":" + name] = raw[8 + n + a:8 + n + b]
    return out


def check_offload(bindir, tmp, model, opts, lr, inmem):
    """The plan of `opts` offloaded (the update on the host: the same CPU
    kernel on the same shard), joined in the next step, and with its state
    on NVMe: each placed so, bitwise the in-memory run `inmem` (its losses),
    the arena as planned. Returns the failures."""
    failures = 0
    nvme = os.path.join(tmp, "nvme")
    os.makedirs(nvme, exist_ok=True)
    for name, extra, run_extra in (
            ("offload=optimizer", "offload=optimizer offload-next-step=false", []),
            ("offload-next-step", "offload=optimizer offload-next-step=true", []),
            ("offload-nvme", "offload=optimizer offload-nvme=true", ["--nvme-dir", nvme])):
        opath = os.path.join(tmp, f"o{len(name)}.plan")
        oplan = mp.compile_plan(bindir, model, opath, f"{opts} {extra}")
        got, summary = mp.run(bindir, opath, 2, STEPS, lr + run_extra)
        placed = oplan.get("host_arena_bytes", 0) > 0 and {
            "offload=optimizer": True,
            "offload-next-step": any(i["attrs"].get("carried") for i in oplan["program"]),
            "offload-nvme": oplan.get("nvme_bytes", 0) > 0}[name]
        ok = placed and got == inmem and summary["measured_high_water"] == summary["predicted_peak"]
        failures += not ok
        print(f"  N=2 stage 3, {name}: placed so: {placed}; bitwise the in-memory run: "
              f"{got == inmem}  {'ok' if ok else 'MISMATCH'}")
    return failures


def check_shards(bindir, tmp):
    failures = 0
    one = gpt(GLOBAL_BATCH, os.path.join(tmp, "g4.mlir"))
    ref_path = os.path.join(tmp, "q1.plan")
    ref_plan = mp.compile_plan(bindir, one, ref_path, EIGHT_OPT)
    ref, ref_summary = mp.run(bindir, ref_path, 1, STEPS, LR)
    again, _ = mp.run(bindir, ref_path, 1, STEPS, LR)
    f32_path = os.path.join(tmp, "f1.plan")
    f32_plan = mp.compile_plan(bindir, one, f32_path, "")
    f32, _ = mp.run(bindir, f32_path, 1, STEPS, LR)
    dist = max(rel(a, b) for a, b in zip(ref, f32))
    ok = again == ref and ref[:2] == f32[:2] and ref[2:] != f32[2:] and dist <= EIGHT
    failures += not ok
    print(f"(a) gpt, 8-bit moments, one rank, {STEPS} steps: losses {ref[0]:.6f} .. {ref[-1]:.6f}; "
          f"bitwise again: {again == ref}; steps 1-2 bitwise the f32 moments': "
          f"{ref[:2] == f32[:2]}; steps 3-{STEPS} differ, max rel diff {dist:.1e} (<= {EIGHT})  "
          f"{'ok' if ok else 'MISMATCH'}")

    # Memory: every moment is its shard's codes and scales.
    bufs = ref_plan["buffers"]
    units = {u["name"]: u for u in ref_plan["units"]}
    state = [b for b in bufs if b["kind"] == "state"]
    packed = all(b["dtype"] == "i8" for b in state) and len(state) == 2 * len(units) and all(
        any(b["bytes"] == quantized_bytes(u["shard_numel"], BLOCK)
            for u in units.values() if b["name"].startswith(u["name"] + "."))
        for b in state)
    aligned = all(u["padded_numel"] % BLOCK == 0 for u in units.values())
    got = ref_plan["memory"]["state"]
    ok = (packed and aligned and got == sum(b["bytes"] for b in state)
          and ref_summary["measured_high_water"] == ref_summary["predicted_peak"])
    failures += not ok
    print(f"  optimizer state {got} bytes ({got / f32_plan['memory']['state']:.3f} of the f32 "
          f"moments' {f32_plan['memory']['state']}), each moment its shard's codes and scales: "
          f"{packed}, units padded to whole blocks: {aligned}, arena measured "
          f"{ref_summary['measured_high_water']} == planned {ref_summary['predicted_peak']}  "
          f"{'ok' if ok else 'MISMATCH'}")

    # N ranks. Every layout's blocks are the unit's (fsdp-shard pads units
    # to whole blocks per shard), so two layouts that compute the same
    # gradients bit for bit store the same codes: N=2 at stages 1, 2 and 3
    # against N=2 at stage 0 (DDP: each rank the whole unit's moments in
    # one piece; a 2-rank sum is one addition, a + b, in every collective),
    # with and without two micro-batches, all STEPS bitwise, as with f32
    # moments (the premise, asserted). Against one rank (a batch of 4 in
    # one GEMM where two ranks add two GEMMs of 2: sums in another order,
    # as on any BLAS) and HSDP 2x2 (4 ranks' sums in another order again),
    # the gradients differ in their last bits, and a moment near a code's
    # rounding boundary can then move by a whole code step: within EIGHT,
    # the sanity bound of the codes themselves (f32 moments: ~1e-6).
    runs = {}
    for key, n, extra in (("s0", 2, "stage=0"), ("s1", 2, "stage=1"), ("s2", 2, "stage=2"),
                          ("s3", 2, "stage=3"), ("a0", 2, "stage=0 grad-accum=2"),
                          ("a1", 2, "stage=1 grad-accum=2"), ("h", 4, "stage=3 mesh=2x2")):
        k = int(extra.split("grad-accum=")[1].split()[0]) if "grad-accum=" in extra else 1
        model = gpt(GLOBAL_BATCH // (n * k), os.path.join(tmp, f"g{GLOBAL_BATCH // (n * k)}.mlir"))
        path, fpath = os.path.join(tmp, "x.plan"), os.path.join(tmp, "xf.plan")
        plan = mp.compile_plan(bindir, model, path, f"{EIGHT_OPT} world-size={n} {extra}")
        mp.compile_plan(bindir, model, fpath, f"world-size={n} {extra}")
        losses, summary = mp.run(bindir, path, n, STEPS, LR)
        f32_losses, _ = mp.run(bindir, fpath, n, STEPS, LR)
        runs[key] = (losses, f32_losses)
        err = max(rel(a, b) for a, b in zip(losses, ref))
        whole_blocks = all(u["shard_numel"] % BLOCK == 0 for u in plan["units"])
        ok = (len(losses) == STEPS and err <= EIGHT and whole_blocks
              and summary["measured_high_water"] == summary["predicted_peak"])
        failures += not ok
        print(f"  N={n} {extra:<22} against one rank: max rel diff {err:.1e} (<= {EIGHT}; f32 "
              f"moments {max(rel(a, b) for a, b in zip(f32_losses, f32)):.1e}), shards of whole "
              f"blocks: {whole_blocks}, arena as planned  {'ok' if ok else 'MISMATCH'}")
    for key, base in (("s1", "s0"), ("s2", "s0"), ("s3", "s0"), ("a1", "a0")):
        same8, same32 = runs[key][0] == runs[base][0], runs[key][1] == runs[base][1]
        ok = same8 and same32
        failures += not ok
        print(f"  N=2 {key[0] == 'a' and 'grad-accum=2 ' or ''}stage {key[1]} against stage "
              f"{base[1]}: {STEPS} steps bitwise with 8-bit moments: {same8} (f32 moments: "
              f"{same32})  {'ok' if ok else 'MISMATCH'}")

    # Offloaded updates run the CPU kernel on the same shard: bitwise.
    two = gpt(GLOBAL_BATCH // 2, os.path.join(tmp, "g2.mlir"))
    path = os.path.join(tmp, "z3.plan")
    mp.compile_plan(bindir, two, path, f"{EIGHT_OPT} world-size=2 stage=3")
    inmem, _ = mp.run(bindir, path, 2, STEPS, LR)
    failures += check_offload(bindir, tmp, two, f"{EIGHT_OPT} world-size=2 stage=3", LR, inmem)

    # Resume on the same layout: bitwise. Elsewhere: refused, by name.
    ckpt = os.path.join(tmp, "ckpt")
    whole, _ = mp.run(bindir, path, 2, 6, LR)
    mp.run(bindir, path, 2, 3, LR + ["--ckpt-dir", ckpt, "--save-every", "3"])
    rows, summary = mp.run_rows(bindir, path, 2, 6, LR + ["--resume", ckpt])
    ok = [r["loss"] for r in rows] == whole[3:6] and summary["resumed"]["converted"] == []
    failures += not ok
    print(f"  N=2 stage 3 checkpointed at step 3, resumed to 6: bitwise the uninterrupted run: "
          f"{'ok' if ok else 'MISMATCH'}")
    # Into f32 moments on another layout (stage 2 on the same two ranks, so
    # the same loss sums: one rank sums its batch's loss in another order,
    # a last bit apart): decoded, and said so. Step 4 reads the loaded
    # parameters and step 5's update the decoded moments, exactly what the
    # 8-bit run's update reads: both bitwise its own; step 6 then starts
    # from unencoded f32 moments.
    ftwo = os.path.join(tmp, "f32two.plan")
    mp.compile_plan(bindir, two, ftwo, "world-size=2 stage=2")
    rows, summary = mp.run_rows(bindir, ftwo, 2, 6, LR + ["--resume", ckpt])
    got = {r["step"]: r["loss"] for r in rows}
    converted = summary["resumed"]["converted"]
    ok = (converted == ["exp_avg 8bit -> f32", "exp_avg_sq 8bit -> f32"]
          and summary["resumed"]["resharded"] and got.get(4) == whole[3]
          and got.get(5) == whole[4] and got.get(6) != whole[5])
    failures += not ok
    print(f"  resumed by N=2 stage 2 with f32 moments: converted {converted}; steps 4-5 bitwise "
          f"the 8-bit run, step 6 not: {got.get(4) == whole[3] and got.get(5) == whole[4]}, "
          f"{got.get(6) != whole[5]}  {'ok' if ok else 'MISMATCH'}")
    # Into 8-bit moments of another layout: the codes and scales copied
    # block for block (every layout's blocks are the unit's), exact. One
    # rank resumes it (step 4 reads the loaded parameters: bitwise), and
    # fsdp-ckpt reshard to one rank and back gives the checkpoint's own
    # bytes, every tensor of every rank.
    one8 = os.path.join(tmp, "one8.plan")
    mp.compile_plan(bindir, one, one8, EIGHT_OPT)
    rows, summary = mp.run_rows(bindir, one8, 1, 5, LR + ["--resume", ckpt])
    got = {r["step"]: r["loss"] for r in rows}
    back = os.path.join(tmp, "back")
    for src, plan_path, out in ((ckpt, one8, os.path.join(tmp, "to1")),
                                (os.path.join(tmp, "to1"), path, back)):
        subprocess.run([os.path.join(bindir, "fsdp-ckpt"), "reshard", src, "--plan", plan_path,
                        out], check=True, capture_output=True, timeout=300)
    same = tensors(ckpt) == tensors(back)
    ok = (summary["resumed"]["resharded"] and summary["resumed"]["converted"] == []
          and got.get(4) == whole[3] and len(rows) == 2 and same)
    failures += not ok
    print(f"  resumed by one rank with 8-bit moments: step 4 bitwise: {got.get(4) == whole[3]}; "
          f"fsdp-ckpt reshard to one rank and back: every tensor bitwise: {same}  "
          f"{'ok' if ok else 'MISMATCH'}")
    # Into 8-bit moments from f32 moments, or from 8-bit moments in other
    # blocks: encoded on load, each block to its nearest codes, and said
    # so. fsdp-ckpt reshard writes the encoded moments; check_encoded
    # judges every code and scale against the format's definition; resuming
    # from that output is bitwise resuming from the source (the same
    # encoding on load as offline); step 4 reads the loaded parameters
    # (bitwise the source run's), the steps after it stay within EIGHT.
    blk, two32 = os.path.join(tmp, "blk.plan"), os.path.join(tmp, "two32.plan")
    mp.compile_plan(bindir, two, blk, f"{EIGHT_OPT} optimizer-state-block=128 world-size=2 stage=3")
    mp.compile_plan(bindir, two, two32, "world-size=2 stage=3")
    f32ck = os.path.join(tmp, "ckf")
    f32whole, _ = mp.run(bindir, two32, 2, 6, LR)
    mp.run(bindir, two32, 2, 3, LR + ["--ckpt-dir", f32ck, "--save-every", "3"])
    for label, plan_path, ck, cont, block, said in (
            ("f32 moments into 8-bit (blocks of 256)", path, f32ck, f32whole, BLOCK,
             ["exp_avg f32 -> 8bit", "exp_avg_sq f32 -> 8bit"]),
            ("8-bit blocks of 256 into blocks of 128", blk, ckpt, whole, 128,
             ["exp_avg 8bit -> 8bit in other blocks or units (re-encoded)",
              "exp_avg_sq 8bit -> 8bit in other blocks or units (re-encoded)"])):
        rows, summary = mp.run_rows(bindir, plan_path, 2, 6, LR + ["--resume", ck])
        got = [r["loss"] for r in rows]
        out = os.path.join(tmp, f"enc{block}")
        r = subprocess.run([os.path.join(bindir, "fsdp-ckpt"), "reshard", ck, "--plan", plan_path,
                            out], capture_output=True, text=True, timeout=300)
        worst, codes = check_encoded(ck, out, block)
        offline = [r["loss"] for r in mp.run_rows(bindir, plan_path, 2, 6, LR + ["--resume", out])[0]]
        dist = max(rel(a, b) for a, b in zip(got, cont[3:]))
        ok = (summary["resumed"]["converted"] == said and r.returncode == 0
              and all(c in r.stdout for c in said) and worst is None and offline == got
              and got[0] == cont[3] and dist <= EIGHT)
        failures += not ok
        print(f"  resumed by N=2 stage 3, {label}: converted {summary['resumed']['converted']}; "
              f"fsdp-ckpt reshard: {codes} codes and their scales the nearest: "
              f"{worst or True}; resumed from it bitwise: {offline == got}; step 4 bitwise, "
              f"5-6 within {dist:.1e} of the source run  {'ok' if ok else 'MISMATCH'}")
    # A checkpoint without AdamW's moments (SGD's buffer) has nothing to
    # encode: refused, naming the state.
    sgd, sgdck = os.path.join(tmp, "sgd.plan"), os.path.join(tmp, "cks")
    mp.compile_plan(bindir, two, sgd, "optimizer=sgd momentum=0.9 world-size=2 stage=3")
    mp.run(bindir, sgd, 2, 2, LR + ["--ckpt-dir", sgdck, "--save-every", "2"])
    r = subprocess.run([os.path.join(bindir, "fsdp-run"), path, "--steps", "3", "--nproc", "2",
                        "--threads", "1", "--resume", sgdck] + LR,
                       capture_output=True, text=True, timeout=300)
    ok = r.returncode != 0 and "has no counterpart" in r.stderr and "exp_avg" in r.stderr
    failures += not ok
    print(f"  an SGD checkpoint into 8-bit moments: refused ({r.returncode}), naming the state: "
          f"{ok}  {'ok' if ok else 'MISMATCH'}")
    return failures


F32 = struct.Struct("<f")


def f32(x):
    """x rounded to float32 (nearest even). Of one +, *, / or sqrt of
    float32 values computed in float64 this is the float32 operation's
    result: double rounding is innocuous at 53 >= 2 * 24 + 2 bits."""
    return F32.unpack(F32.pack(x))[0]


def code_values(k):
    """Moments8.h's magnitude codes of k mantissa bits: f x 2^(-6-k) for
    exponent 0, else 2^(e-7) x (1 + f / 2^k), by the format's definition."""
    out = []
    for c in range(1 << (4 + k)):
        e, f = c >> k, c & ((1 << k) - 1)
        out.append(f * 2.0 ** (-6 - k) if e == 0 else 2.0 ** (e - 7) * (1 + f / (1 << k)))
    return out


def unit_states(step_dir):
    """(unit, kind) -> a unit's optimizer state (its shards joined), and the
    unit's flat size: f32 values, or 8-bit (codes, scales)."""
    index = json.load(open(os.path.join(step_dir, "index.json")))
    m = index["shard_map"]
    files = sorted(f for f in os.listdir(step_dir) if f.endswith(".safetensors"))
    raw = []
    for f in files:
        with open(os.path.join(step_dir, f), "rb") as fh:
            data = fh.read()
        n = int.from_bytes(data[:8], "little")
        raw.append((json.loads(data[8:8 + n]), data[8 + n:]))
    buffers = {b["id"]: b for b in m["buffers"]}
    units = {u["name"]: u for u in m["units"]}
    out = {}
    for st in m["states"]:
        u, b = units[st["unit"]], buffers[st["buffer"]]
        parts = []
        for header, body in raw[:len(raw) if u["sharded"] else 1]:
            lo, hi = header[b["tensor"]]["data_offsets"]
            parts.append(body[lo:hi])
        if b["dtype"] == "i8" and b.get("state_bits") == 4:  # two codes a byte
            n = u["shard_numel"] if u["sharded"] else u["padded_numel"]
            at = ((n + 1) // 2 + 3) // 4 * 4
            codes = [c >> s & 15 for p in parts for c in p[:(n + 1) // 2] for s in (0, 4)]
            scales = [x for p in parts for (x,) in F32.iter_unpack(p[at:])]
            out[(st["unit"], st["kind"])] = ("4bit", codes, scales, u["flat_numel"])
        elif b["dtype"] == "i8":
            n = u["shard_numel"] if u["sharded"] else u["padded_numel"]
            at = (n + 3) // 4 * 4
            codes = b"".join(p[:n] for p in parts)
            scales = [x for p in parts for (x,) in F32.iter_unpack(p[at:])]
            out[(st["unit"], st["kind"])] = ("8bit", codes, scales, u["flat_numel"])
        else:
            vals = [x for p in parts for (x,) in F32.iter_unpack(p)]
            out[(st["unit"], st["kind"])] = ("f32", vals, None, u["flat_numel"])
    return out


def newest(ckpt):
    return os.path.join(ckpt, sorted(d for d in os.listdir(ckpt) if d.startswith("step-"))[-1])


def check_encoded(src_ckpt, enc_ckpt, block):
    """Every unit's 8-bit moments in enc_ckpt against the source checkpoint's
    moments (f32, or 8-bit decoded as Moments8.h defines: code value x scale,
    exp_avg_sq that squared): per block of `block` over the unit, the scale
    is float32(amax / kMax) of the block's largest magnitude (exp_avg_sq:
    of the roots; amax itself below 2^-100), and each code is the one whose
    value is nearest |x| x float32(kMax / amax) (ties: the even code; the
    largest code above it), with x's sign for exp_avg. Returns (None, codes
    checked), or (the first difference, codes checked)."""
    src, enc = unit_states(newest(src_ckpt)), unit_states(newest(enc_ckpt))
    vals_of = {3: code_values(3), 4: code_values(4)}
    checked = 0
    for key, (dt, codes, scales, flat) in enc.items():
        sdt, svals, sscales, sflat = src[key]
        root = key[1] == "exp_avg_sq"
        k = 4 if root else 3
        values, kmax = vals_of[k], vals_of[k][-1]
        if dt != "8bit" or sflat != flat:
            return f"{key}: not 8-bit, or another unit", checked
        if sdt == "8bit":  # decoded: the 8-bit source's block size from its sizes
            sblock = len(svals) // len(sscales)
            if root:
                svals = [f32(f32(values[c] * sscales[i // sblock]) ** 2)
                         for i, c in enumerate(svals)]
            else:
                svals = [(-1 if c & 0x80 else 1) * f32(values[c & 0x7f] * sscales[i // sblock])
                         for i, c in enumerate(svals)]
        x = list(svals[:flat]) + [0.0] * (len(codes) - flat)
        if root:
            x = [f32(math.sqrt(v)) for v in x]
        for j in range(len(codes) // block):
            blk_x = x[j * block:(j + 1) * block]
            amax = max(abs(v) for v in blk_x)
            quant = amax >= 2.0 ** -100
            want = f32(amax / kmax) if quant else amax
            if scales[j] != want:
                return f"{key} block {j}: scale {scales[j]!r}, the definition's {want!r}", checked
            inv = f32(kmax / amax) if quant else 0.0
            for i, v in enumerate(blk_x):
                c = codes[j * block + i]
                sign, mag = (c & 0x80, c & 0x7f) if not root else (0, c)
                y = f32(abs(v) * inv)
                at = bisect.bisect_left(values, y)  # the codes either side of y
                near = [t for t in (at - 1, at) if 0 <= t < len(values)]
                best = min(near, key=lambda t: (abs(values[t] - y), t & 1)) if quant else 0
                want_sign = 0x80 if (not root and math.copysign(1, v) < 0 and quant) else 0
                if mag != best or sign != want_sign:
                    return (f"{key} element {j * block + i}: code {c}, the nearest "
                            f"{best | want_sign} (x {v!r}, y {y!r})"), checked
                checked += 1
    return None, checked


# Moments4.h's levels as float32 holds them: exp_avg's signed map,
# exp_avg_sq's roots' 2^(-(15 - c) / 2).
LEVELS_M4 = [f32(x) for x in (-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                              0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0)]
LEVELS_V4 = [f32(2.0 ** (-(15 - c) / 2)) for c in range(16)]


def check_encoded4(src_ckpt, enc_ckpt, block):
    """check_encoded for 4-bit moments from an f32 source: per block of
    `block` over the unit, the scale is the block's largest magnitude
    (exp_avg_sq: of the roots; 0 below 2^-100) and each code the level
    nearest float32(x * float32(1 / scale)) (a tie: the lower level; a
    block of zeros: exp_avg's zero code 7, exp_avg_sq's 0)."""
    src, enc = unit_states(newest(src_ckpt)), unit_states(newest(enc_ckpt))
    checked = 0
    for key, (dt, codes, scales, flat) in enc.items():
        sdt, svals, _, sflat = src[key]
        root = key[1] == "exp_avg_sq"
        levels = LEVELS_V4 if root else LEVELS_M4
        if dt != "4bit" or sdt != "f32" or sflat != flat:
            return f"{key}: not 4-bit from f32, or another unit", checked
        x = list(svals[:flat]) + [0.0] * (len(scales) * block - flat)
        if root:
            x = [f32(math.sqrt(v)) for v in x]
        for j in range(len(scales)):
            blk_x = x[j * block:(j + 1) * block]
            amax = max(abs(v) for v in blk_x)
            quant = amax >= 2.0 ** -100
            if scales[j] != (amax if quant else 0.0):
                return f"{key} block {j}: scale {scales[j]!r}, the block's largest {amax!r}", checked
            inv = f32(1.0 / amax) if quant else 0.0
            for i, v in enumerate(blk_x):
                y = f32(v * inv)
                best = min(range(16), key=lambda c: (abs(levels[c] - y), c)) if quant else (
                    0 if root else 7)
                if codes[j * block + i] != best:
                    return (f"{key} element {j * block + i}: code {codes[j * block + i]}, the "
                            f"nearest {best} (x {v!r}, y {y!r})"), checked
                checked += 1
    return None, checked


def check_text(bindir, tmp, tokens):
    """(b) 200 steps of the small GPT on text tokens (optimizer_state_bf16.py's
    (b) setting): f32, 8-bit and 4-bit moments. 4-bit's window means are
    held within 0.05 of f32's (8-bit's 0.02): its codes are coarser (exp_avg
    levels up to 0.225 of the block's largest apart, roots sqrt(2) apart),
    so the early windows, where the moments change fastest, lag most
    (measured 1.8% in the first window, 0.4% in the last)."""
    failures = 0
    model = os.path.join(HERE, "..", "..", "examples", "gpt_small.mlir")
    args = ["--data", tokens, "--lr", "1e-3", "--schedule", "cosine", "--warmup", "10",
            "--threads", "2"]
    runs = {}
    for label, pipeline in (("f32", ""), ("8-bit", EIGHT_OPT),
                            ("4-bit", "optimizer-state-dtype=4bit")):
        path = os.path.join(tmp, f"text_{label}.plan")
        mp.compile_plan(bindir, model, path, f"max-grad-norm=1.0 {pipeline}")
        rows, _ = mp.run_rows(bindir, path, 1, 200, args)
        runs[label] = [r["loss"] for r in rows]
    print("(b) gpt_small on text, 200 steps, 50-step window means against f32 moments")
    f32, eight = mp.window_means(runs["f32"]), mp.window_means(runs["8-bit"])
    for w, (a, b) in enumerate(zip(eight, f32)):
        ok = rel(a, b) <= 0.02
        failures += not ok
        print(f"  steps {w * 50 + 1:>3}..{(w + 1) * 50:<3} mean loss f32 {b:.4f} 8-bit {a:.4f} "
              f"rel diff {rel(a, b):.4f} (<= 0.02)  {'ok' if ok else 'MISMATCH'}")
    four = mp.window_means(runs["4-bit"])
    for w, (a, b) in enumerate(zip(four, f32)):
        ok = rel(a, b) <= 0.05
        failures += not ok
        print(f"  steps {w * 50 + 1:>3}..{(w + 1) * 50:<3} mean loss f32 {b:.4f} 4-bit {a:.4f} "
              f"rel diff {rel(a, b):.4f} (<= 0.05)  {'ok' if ok else 'MISMATCH'}")
    for label in ("8-bit", "4-bit"):
        last = sum(runs[label][150:]) / 50
        ok = last < 0.6 * math.log(256)
        failures += not ok
        print(f"  {label} last-window mean {last:.4f} < 0.6 ln 256: {'ok' if ok else 'MISMATCH'}")
    dist = sum(rel(a, b) for a, b in zip(eight, f32)) / 4
    dist4 = sum(rel(a, b) for a, b in zip(four, f32)) / 4
    final = {k: sum(v[190:]) / 10 for k, v in runs.items()}
    print(f"  measured: mean rel distance of the window means from f32 {dist:.5f} (8-bit), "
          f"{dist4:.5f} (4-bit); steps 191-200 mean loss f32 {final['f32']:.4f}, 8-bit "
          f"{final['8-bit']:.4f}, 4-bit {final['4-bit']:.4f}")
    return failures


def check_cuda(bindir, tmp, runner):
    """(c) --device cuda (RUN_BINARY: fsdp-run-emu here, fsdp-run on a GPU)
    against the CPU device, 6 steps of the small GPT in f32 with 8-bit
    moments at lr 1e-2: step 1 within 1e-6 (the kernels' f32 summation
    orders differ), every step within EIGHT, and --cuda-graphs bitwise the
    eager run. Not within 1e-4 as f32 moments are: the devices' gradients
    differ in their last bits (the emulator's f32 losses stay bitwise the
    CPU's for 5 steps, its parameters do not), and a code whose value lies
    near a rounding boundary, or a block's largest magnitude, then encodes
    differently: that element's moment moves by a code step (1/16 of
    exp_avg, 1/32 of v's root) where f32 moments move by an ulp. Each
    device's run is then an 8-bit run of its own within quantization noise
    of the f32 run, so they are held to (a)'s 8-bit-vs-f32 bound (measured:
    2.1e-4 on the emulator). The CUDA update's bytes for the same inputs
    are the CPU's: DeviceConformance checks them."""
    failures = 0
    model = gpt(GLOBAL_BATCH, os.path.join(tmp, "g4.mlir"))
    path = os.path.join(tmp, "c.plan")
    for label, extra, lr in (("8-bit moments", "", LR),
                             ("SGD's 8-bit momentum buffer", "optimizer=sgd momentum=0.9",
                              ["--lr", "0.05"]),
                             ("LAMB's 8-bit moments", "optimizer=lamb", ["--lr", "0.02"])):
        mp.compile_plan(bindir, model, path, f"{EIGHT_OPT} {extra}")
        cpu, cuda, graphs = cuda_runs(bindir, runner, path, extra=lr)
        err = max(rel(a, b) for a, b in zip(cuda, cpu))
        first = rel(cuda[0], cpu[0])
        ok = len(cuda) == 6 and first <= 1e-6 and err <= EIGHT
        failures += not ok
        print(f"(c) {label} on cuda vs cpu, 6 steps: step 1 rel diff {first:.1e} (<= 1e-6), "
              f"max {err:.2e} (<= {EIGHT}), steps 1-3 bitwise: {cuda[:3] == cpu[:3]}  "
              f"{'ok' if ok else 'MISMATCH'}")
        ok = graphs == cuda
        failures += not ok
        print(f"  --cuda-graphs == eager bitwise: {'ok' if ok else 'MISMATCH'}")
    return failures


class EightBitRun:
    """(d) and (e)'s shared checks for the optimizer `opt` (its pipeline
    options) with state `kinds` at `lr`, the words `what` ("momentum
    buffer", "moments") in the lines; `verdict(ok)` counts a failure."""

    def __init__(self, bindir, tmp, opt, lr, kinds, what, verdict, bits=8):
        self.bindir, self.tmp, self.opt, self.lr = bindir, tmp, opt, lr
        self.kinds, self.what, self.verdict = kinds, what, verdict
        # the code width: its option, dtype name, bytes, share of f32's
        self.bits, self.coded = bits, f"{bits}bit"
        self.option = f"optimizer-state-dtype={self.coded}"
        self.block = BLOCK if bits == 8 else BLOCK4
        self.bytes = quantized_bytes if bits == 8 else packed4_bytes
        self.share = 0.26 if bits == 8 else 0.14
        self.bound = EIGHT if bits == 8 else FOUR
        self.whose = what + ("'" if what.endswith("s") else "'s")
        self.one = gpt(GLOBAL_BATCH, os.path.join(tmp, "g4.mlir"))
        self.two = gpt(GLOBAL_BATCH // 2, os.path.join(tmp, "g2.mlir"))

    def plan(self, model, name, extra):
        path = os.path.join(self.tmp, name + ".plan")
        return path, mp.compile_plan(self.bindir, model, path, f"{self.opt} {extra}")

    def one_rank(self, label):
        """One rank: steps 1-2 bitwise the f32 state's run, the rest within
        EIGHT; every state its shard's codes and scales, the state about a
        quarter of the f32 plan's, the arena as planned. Returns the losses."""
        q1, q1_plan = self.plan(self.one, "q1", self.option)
        f1, f1_plan = self.plan(self.one, "f1", "")
        ref, summary = mp.run(self.bindir, q1, 1, STEPS, self.lr)
        f32, _ = mp.run(self.bindir, f1, 1, STEPS, self.lr)
        dist = max(rel(a, b) for a, b in zip(ref, f32))
        print(f"{label}, one rank: losses {ref[0]:.6f} .. {ref[-1]:.6f}; steps 1-2 bitwise the "
              f"f32 {self.whose}: {ref[:2] == f32[:2]}; steps 3-{STEPS} differ, max rel diff "
              f"{dist:.1e} (<= {self.bound})  "
              f"{self.verdict(ref[:2] == f32[:2] and ref[2:] != f32[2:] and dist <= self.bound)}")
        units = {u["name"]: u for u in q1_plan["units"]}
        state = [b for b in q1_plan["buffers"] if b["kind"] == "state"]
        unit = [units.get(b["name"].rsplit(".", 1)[0]) for b in state]
        packed = len(state) == len(self.kinds) * len(units) and all(
            u is not None and b["dtype"] == "i8" and b["name"].rsplit(".", 1)[1] in self.kinds
            and b["bytes"] == self.bytes(u["shard_numel"], self.block)
            for b, u in zip(state, unit))
        got, f32_state = q1_plan["memory"]["state"], f1_plan["memory"]["state"]
        ok = (packed and got == sum(b["bytes"] for b in state) and got < self.share * f32_state
              and summary["measured_high_water"] == summary["predicted_peak"])
        print(f"  optimizer state {got} bytes ({got / f32_state:.3f} of the f32 {self.whose} "
              f"{f32_state}), each its shard's codes and scales: {packed}, arena as planned  "
              f"{self.verdict(ok)}")
        return ref

    def resumes(self, z3, runs3, decoded_at):
        """A 2-rank ZeRO-3 checkpoint at step 3 (plan z3, uninterrupted
        losses runs3) resumes bitwise; the plan `decoded_at` with f32 state
        loads it decoded (steps 4-5 bitwise, step 6 not, the conversion
        said); an f32-state checkpoint loads encoded into z3 (every code and
        scale of fsdp-ckpt reshard's output the nearest: check_encoded;
        resuming from it bitwise resuming from the source; step 4's loss
        the f32 run's: the codes enter from its update on)."""
        lr, b = self.lr, self.bindir
        ckpt = os.path.join(self.tmp, "ck")
        mp.run(b, z3, 2, 3, lr + ["--ckpt-dir", ckpt, "--save-every", "3"])
        rows, summary = mp.run_rows(b, z3, 2, 6, lr + ["--resume", ckpt])
        ok = [r["loss"] for r in rows] == runs3[3:6] and summary["resumed"]["converted"] == []
        print(f"  N=2 stage 3 checkpointed at step 3, resumed to 6: bitwise the uninterrupted "
              f"run: {self.verdict(ok)}")
        f2, _ = self.plan(self.two, "f2", decoded_at)
        rows, summary = mp.run_rows(b, f2, 2, 6, lr + ["--resume", ckpt])
        conv, got = summary["resumed"]["converted"], [r["loss"] for r in rows]
        ok = (conv == [f"{k} {self.coded} -> f32" for k in self.kinds]
              and summary["resumed"]["resharded"]
              and got[:2] == runs3[3:5] and got[2] != runs3[5])
        print(f"  resumed by N=2 {decoded_at.split()[-1].replace('=', ' ')} with f32 "
              f"{self.what}: converted {conv}; steps 4-5 bitwise the {self.bits}-bit run, step 6 not: "
              f"{self.verdict(ok)}")
        f3, _ = self.plan(self.two, "f3", "world-size=2 stage=3")
        f32ck = os.path.join(self.tmp, "ckf")
        f32whole, _ = mp.run(b, f3, 2, 6, lr)
        mp.run(b, f3, 2, 3, lr + ["--ckpt-dir", f32ck, "--save-every", "3"])
        rows, summary = mp.run_rows(b, z3, 2, 6, lr + ["--resume", f32ck])
        got = [r["loss"] for r in rows]
        out = os.path.join(self.tmp, "enc")
        r = subprocess.run([os.path.join(b, "fsdp-ckpt"), "reshard", f32ck, "--plan", z3, out],
                           capture_output=True, text=True, timeout=300)
        worst, codes = (check_encoded(f32ck, out, BLOCK) if self.bits == 8
                        else check_encoded4(f32ck, out, self.block))
        offline = [x["loss"] for x in mp.run_rows(b, z3, 2, 6, lr + ["--resume", out])[0]]
        conv = summary["resumed"]["converted"]
        ok = (conv == [f"{k} f32 -> {self.coded}" for k in self.kinds] and r.returncode == 0
              and worst is None and offline == got and got[0] == f32whole[3]
              and max(rel(a, b) for a, b in zip(got, f32whole[3:])) <= EIGHT)
        print(f"  an f32-state checkpoint into the {self.bits}-bit plan: converted {conv}; fsdp-ckpt "
              f"reshard: {codes} codes and their scales the nearest: {worst or True}; resumed "
              f"from it bitwise: {offline == got}; step 4 bitwise  {self.verdict(ok)}")


def check_sgd(bindir, tmp):
    """(d): SGD's 8-bit momentum buffer (see the docstring)."""
    failures = 0

    def verdict(ok):
        nonlocal failures
        failures += not ok
        return "ok" if ok else "MISMATCH"

    sgd, lr = "optimizer=sgd momentum=0.9 nesterov=true", ["--lr", "0.05"]
    run = EightBitRun(bindir, tmp, sgd, lr, ("momentum_buffer",), "buffer", verdict)
    ref = run.one_rank("(d) gpt, SGD with an 8-bit momentum buffer")
    runs = {}
    for stage in range(4):
        path, _ = run.plan(run.two, f"s{stage}", f"{EIGHT_OPT} world-size=2 stage={stage}")
        runs[stage], _ = mp.run(bindir, path, 2, STEPS, lr)
    err = max(rel(a, b) for a, b in zip(runs[0], ref))
    print(f"  N=2 stage 0 against one rank: max rel diff {err:.1e} (<= {EIGHT})  "
          f"{verdict(len(runs[0]) == STEPS and err <= EIGHT)}")
    for stage in (1, 2, 3):
        print(f"  N=2 stage {stage} against stage 0: {STEPS} steps bitwise: "
              f"{verdict(runs[stage] == runs[0])}")
    failures += check_offload(bindir, tmp, run.two, f"{sgd} {EIGHT_OPT} world-size=2 stage=3", lr,
                              runs[3])
    # Another layout with an f32 buffer: stage 2 (the same two ranks, so
    # the same loss sums).
    run.resumes(os.path.join(tmp, "s3.plan"), runs[3], "world-size=2 stage=2")
    return failures


def check_lamb(bindir, tmp):
    """(e): LAMB's 8-bit moments (see the docstring)."""
    failures = 0

    def verdict(ok):
        nonlocal failures
        failures += not ok
        return "ok" if ok else "MISMATCH"

    lamb, lr = "optimizer=lamb", ["--lr", "0.02"]
    run = EightBitRun(bindir, tmp, lamb, lr, ("exp_avg", "exp_avg_sq"), "moments", verdict)
    ref = run.one_rank("(e) gpt, LAMB with 8-bit moments")
    runs = {}
    for stage in range(4):
        path, _ = run.plan(run.two, f"s{stage}", f"{EIGHT_OPT} world-size=2 stage={stage}")
        runs[stage], _ = mp.run(bindir, path, 2, STEPS, lr)
    for stage in (0, 1):
        err = max(rel(a, b) for a, b in zip(runs[stage], ref))
        print(f"  N=2 stage {stage} against one rank: max rel diff {err:.1e} (<= {EIGHT})  "
              f"{verdict(len(runs[stage]) == STEPS and err <= EIGHT)}")
    for stage in (2, 3):
        print(f"  N=2 stage {stage} against stage 1: {STEPS} steps bitwise: "
              f"{verdict(runs[stage] == runs[1])}")
    failures += check_offload(bindir, tmp, run.two, f"{lamb} {EIGHT_OPT} world-size=2 stage=3", lr,
                              runs[3])
    # Stage 2 with f32 moments: the same shards, so the same norms' sums.
    run.resumes(os.path.join(tmp, "s3.plan"), runs[3], "world-size=2 stage=2")
    return failures


def check_four(bindir, tmp):
    """(f): AdamW's 4-bit moments (see the docstring)."""
    failures = 0

    def verdict(ok):
        nonlocal failures
        failures += not ok
        return "ok" if ok else "MISMATCH"

    run = EightBitRun(bindir, tmp, "optimizer=adamw", LR, ("exp_avg", "exp_avg_sq"), "moments",
                      verdict, bits=4)
    ref = run.one_rank("(f) gpt, AdamW with 4-bit moments")
    runs = {}
    for stage in range(4):
        path, _ = run.plan(run.two, f"s{stage}", f"{run.option} world-size=2 stage={stage}")
        runs[stage], _ = mp.run(bindir, path, 2, STEPS, LR)
    err = max(rel(a, b) for a, b in zip(runs[0], ref))
    print(f"  N=2 stage 0 against one rank: max rel diff {err:.1e} (<= {EIGHT})  "
          f"{verdict(len(runs[0]) == STEPS and err <= EIGHT)}")
    for stage in (1, 2, 3):
        print(f"  N=2 stage {stage} against stage 0: {STEPS} steps bitwise: "
              f"{verdict(runs[stage] == runs[0])}")
    failures += check_offload(bindir, tmp, run.two, f"{run.option} world-size=2 stage=3", LR,
                              runs[3])
    z3 = os.path.join(tmp, "s3.plan")
    run.resumes(z3, runs[3], "world-size=2 stage=2")
    # Into 4-bit moments of another layout: codes (whole bytes: blocks are
    # even) and scales copied block for block, exact. One rank resumes the
    # 2-rank checkpoint (step 4 reads the loaded parameters: bitwise), and
    # fsdp-ckpt reshard to one rank and back gives every tensor's bytes.
    one4, _ = run.plan(run.one, "one4", run.option)
    ckpt = os.path.join(tmp, "ck")
    rows, summary = mp.run_rows(bindir, one4, 1, 5, LR + ["--resume", ckpt])
    got = {r["step"]: r["loss"] for r in rows}
    back = os.path.join(tmp, "back4")
    for src, plan_path, out in ((ckpt, one4, os.path.join(tmp, "to1")),
                                (os.path.join(tmp, "to1"), z3, back)):
        subprocess.run([os.path.join(bindir, "fsdp-ckpt"), "reshard", src, "--plan", plan_path,
                        out], check=True, capture_output=True, timeout=300)
    same = tensors(ckpt) == tensors(back)
    ok = (summary["resumed"]["resharded"] and summary["resumed"]["converted"] == []
          and got.get(4) == runs[3][3] and len(rows) == 2 and same)
    print(f"  resumed by one rank with 4-bit moments: step 4 bitwise: {got.get(4) == runs[3][3]}; "
          f"fsdp-ckpt reshard to one rank and back: every tensor bitwise: {same}  {verdict(ok)}")
    # 8-bit and 4-bit checkpoints of one layout: same bytes counts never
    # meet, but the width is named (state_bits), so each loads decoded
    # into the other's plan as values, never as the other's codes.
    ck8 = os.path.join(tmp, "ck8")
    p8, _ = run.plan(run.two, "e3", f"{EIGHT_OPT} world-size=2 stage=3")
    mp.run(bindir, p8, 2, 3, LR + ["--ckpt-dir", ck8, "--save-every", "3"])
    rows, summary = mp.run_rows(bindir, os.path.join(tmp, "s3.plan"), 2, 4,
                                LR + ["--resume", ck8])
    conv = summary["resumed"]["converted"]
    print(f"  an 8-bit checkpoint into the 4-bit plan: converted {conv}  "
          f"{verdict(conv == [f'{k} 8bit -> 4bit' for k in run.kinds] and len(rows) == 1)}")
    return failures


def main():
    return main_modes(__doc__, "8-bit optimizer state checks pass",
                      {"shards": (0, check_shards), "text": (1, check_text),
                       "cuda": (1, check_cuda), "sgd": (0, check_sgd),
                       "lamb": (0, check_lamb), "four": (0, check_four)})

if __name__ == "__main__":
    sys.exit(main())
