#!/usr/bin/env python3
"""bf16 trainable parameters without an f32 master (fsdp-mixed-precision
master-dtype=bf16) end to end on CPU ranks.

usage: bf16_master.py BIN_DIR shards            (a) layouts, resume, checkpoints, bytes
       bf16_master.py BIN_DIR text TOKENS.bin   (b) 200 steps against f32 masters
       bf16_master.py BIN_DIR cuda RUN_BINARY   (c) --device cuda == the CPU

What it is: each trainable unit stores bf16, its compute dtype. The step
gathers it as stored (no cast), and the unit's update widens it, steps in
f32 (f32 gradients, the chosen state) and rounds the new parameters to bf16
once: with stochastic-rounding=true stochastically, with the draws the
stochastic cast of an f32 master makes (runtime/core/StochasticRounding.h:
seed, step, unit, the element's index in the unit), else to nearest. The
parameters cost 2 bytes instead of 4; an update below half a bf16 ulp moves
a parameter with probability (update / ulp) instead of never.

(a) The small GPT, global batch 4, AdamW, stochastic:
    - two one-rank runs are bitwise equal;
    - N=2 at stages 1, 2 and 3 (and stage 3 with the optimizer offloaded)
      are bitwise N=2 at stage 0 for all 10 steps, and stages 1 and 3
      with two micro-batches bitwise stage 0 with two: a 2-rank sum is one
      addition in every collective, so the gradients are the same bits,
      and each rank's shard draws what stage 0's whole unit draws at those
      positions. A shard drawing at another offset, or with another key,
      moves the losses (the nearest-rounding run below shows by how much);
    - rounding to nearest instead is a different run from step 2 on (step
      1 computes with the initial parameters, the same in both);
    - one rank and HSDP 2x2 within D u of N=2 (their gradient sums differ
      in order, as in mixed_precision.py's argument);
    - a 2-rank stage-3 run checkpointed at step 3 and resumed to 6 is
      bitwise the uninterrupted run;
    - checkpoints cross: a bf16-master checkpoint resumed by an f32-master
      plan (widened exactly: its step 4 computes with the same bf16 values,
      so its loss is bitwise the bf16-master run's step 4), and an
      f32-master checkpoint resumed by a bf16-master plan (rounded to
      nearest once), each naming the conversion;
    - the plan stores the parameters in half the bytes of the f32 master's;
    - `fsdp-ckpt export` of the bf16-master checkpoint: F32 by default, the
      bf16 values widened exactly (bitwise the run's --save, every low half
      zero); `--dtype bf16` half the bytes, the same values; `--init-from`
      either file gives the same first loss. `--dtype bf16` of the
      f32-master checkpoint is PyTorch's .to(torch.bfloat16) of its F32
      export, bitwise (rounding to nearest even).
(b) gpt_small on text tokens, 200 steps (mixed_precision.py's (b) setting):
    f32; bf16 compute on f32 masters; bf16 masters rounded stochastically;
    bf16 masters rounded to nearest. Every 50-step window mean of the
    stochastic bf16-master run within D u of f32's (the bound bf16 compute
    is held to), and it learns. The nearest-rounding run is measured and
    printed, not bounded (it loses the updates below half an ulp; how much
    that costs depends on the learning rate and the run length).
(c) The stochastic plan (AdamW with f32 moments, and with 8-bit moments)
    on --device cuda (RUN_BINARY: fsdp-run-emu here, fsdp-run on a GPU)
    against the CPU device: every step within D u (the bf16 kernels sum in
    another f32 order; the update's rounding is the same bits,
    DeviceConformance.Bf16ParametersAreTheF32UpdateRoundedOnce), and
    --cuda-graphs (the step captured once, each replay reading its step's
    draws from device memory) bitwise the eager run.
"""
import struct
import subprocess
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mixed_precision as mp  # noqa: E402
import stochastic_rounding as sr  # noqa: E402
from e2e_lib import cuda_runs, main_modes, safetensors  # noqa: E402

U = 2.0 ** -8
STEPS = 10
SR = "param-dtype=bf16 master-dtype=bf16 stochastic-rounding=true"


def rel(a, b):
    return abs(a - b) / abs(b)


def param_bytes(plan):
    return sum(plan["buffers"][u["buffer"]]["bytes"] for u in plan["units"]
               if u.get("buffer", -1) >= 0)


def check_shards(bindir, tmp):
    failures = 0

    def verdict(ok):
        nonlocal failures
        failures += not ok
        return "ok" if ok else "MISMATCH"

    g4 = sr.gpt(4, os.path.join(tmp, "g4.mlir"))
    g2 = sr.gpt(2, os.path.join(tmp, "g2.mlir"))
    one_path = os.path.join(tmp, "one.plan")
    one_plan = mp.compile_plan(bindir, g4, one_path, SR)
    rtol = mp.rounding_depth(one_plan) * U
    one, _ = mp.run(bindir, one_path, 1, STEPS)
    again, _ = mp.run(bindir, one_path, 1, STEPS)
    print(f"(a) gpt, bf16 masters rounded stochastically, {STEPS} steps: one rank "
          f"{one[0]:.6f} .. {one[-1]:.6f}; D u = {rtol:.4f}")
    print(f"  a second one-rank run is bitwise the first: {verdict(again == one)}")

    def losses(n, model, extra, steps=STEPS, run_extra=()):
        path = os.path.join(tmp, "x.plan")
        mp.compile_plan(bindir, model, path, f"{SR} world-size={n} {extra}")
        return mp.run(bindir, path, n, steps, list(run_extra))[0]

    stage0 = losses(2, g2, "stage=0")
    for extra in ("stage=1", "stage=2", "stage=3", "stage=3 offload=optimizer"):
        got = losses(2, g2, extra)
        print(f"  N=2 {extra:<26} bitwise N=2 stage 0 for {STEPS} steps: "
              f"{verdict(got == stage0)}")
    g1 = sr.gpt(1, os.path.join(tmp, "g1.mlir"))
    accum0 = losses(2, g1, "stage=0 grad-accum=2")
    for extra in ("stage=1 grad-accum=2", "stage=3 grad-accum=2"):
        got = losses(2, g1, extra)
        print(f"  N=2 {extra:<26} bitwise N=2 stage 0 grad-accum=2: {verdict(got == accum0)}")
    nearest_path = os.path.join(tmp, "rn.plan")
    mp.compile_plan(bindir, g2, nearest_path,
                    "param-dtype=bf16 master-dtype=bf16 world-size=2 stage=3")
    nearest, _ = mp.run(bindir, nearest_path, 2, STEPS)
    apart = max(rel(a, b) for a, b in zip(nearest[1:], stage0[1:]))
    ok = nearest[0] == stage0[0] and apart > 1e-6
    print(f"  rounding to nearest: step 1 the same bits, steps 2-{STEPS} apart by up to "
          f"{apart:.1e} (> 1e-6): {verdict(ok)}")
    for n, model, extra in ((1, g4, ""), (4, g1, "stage=3 mesh=2x2")):
        got = losses(n, model, extra)
        err = max(rel(a, b) for a, b in zip(got, stage0))
        print(f"  N={n} {extra or 'one rank':<26} within D u of N=2: max rel diff {err:.2e} "
              f"(<= {rtol:.4f}) {verdict(len(got) == STEPS and err <= rtol)}")

    # Resume, and checkpoints across master dtypes.
    ck_path = os.path.join(tmp, "ck.plan")
    ck_plan = mp.compile_plan(bindir, g2, ck_path, f"{SR} world-size=2 stage=3")
    ckpt = os.path.join(tmp, "ckpt")
    saved = os.path.join(tmp, "saved.safetensors")
    mp.run(bindir, ck_path, 2, 3, ["--ckpt-dir", ckpt, "--save-every", "3", "--save", saved])
    rows, summary = mp.run_rows(bindir, ck_path, 2, 6, ["--resume", ckpt])
    resumed = [r["loss"] for r in rows]
    print(f"  N=2 stage 3 checkpointed at step 3, resumed to 6: bitwise the uninterrupted "
          f"run: {verdict(resumed == stage0[3:6])}")
    f32_path = os.path.join(tmp, "f32m.plan")
    f32_plan = mp.compile_plan(bindir, g2, f32_path,
                               "param-dtype=bf16 stochastic-rounding=true world-size=2 stage=3")
    rows, summary = mp.run_rows(bindir, f32_path, 2, 4, ["--resume", ckpt])
    conv = summary.get("resumed", {}).get("converted")
    ok = conv == ["parameters bf16 -> f32"] and rows[0]["loss"] == stage0[3]
    print(f"  bf16-master checkpoint resumed by an f32-master plan: {conv}, step 4 loss "
          f"bitwise the bf16-master run's: {verdict(ok)}")
    ckpt32 = os.path.join(tmp, "ckpt32")
    mp.run(bindir, f32_path, 2, 3, ["--ckpt-dir", ckpt32, "--save-every", "3"])
    cont32, _ = mp.run(bindir, f32_path, 2, 6)
    rows, summary = mp.run_rows(bindir, ck_path, 2, 6, ["--resume", ckpt32])
    conv = summary.get("resumed", {}).get("converted")
    err = max(rel(r["loss"], b) for r, b in zip(rows, cont32[3:6]))
    ok = conv == ["parameters f32 -> bf16"] and len(rows) == 3 and err <= rtol
    print(f"  f32-master checkpoint resumed by a bf16-master plan: {conv}, steps 4-6 within "
          f"D u of the f32-master run (max rel diff {err:.1e}): {verdict(ok)}")
    ours, theirs = param_bytes(ck_plan), param_bytes(f32_plan)
    print(f"  parameter storage a rank: {ours} B, f32 masters {theirs} B: "
          f"{verdict(2 * ours == theirs)}")
    check_export(bindir, tmp, ckpt, ckpt32, saved, one_path, verdict)  # verdict counts
    return failures


def check_export(bindir, tmp, ckpt, ckpt32, saved, plan1, verdict):
    """fsdp-ckpt export of bf16-master and f32-master checkpoints, F32 and
    --dtype bf16 (see the docstring's (a)); `verdict` counts the failures."""
    tool = os.path.join(bindir, "fsdp-ckpt")

    def export(ck, name, *dtype):
        out = os.path.join(tmp, name)
        subprocess.run([tool, "export", ck, out, *dtype], check=True, capture_output=True)
        return out, safetensors(out)

    f32_path, f32 = export(ckpt, "e32.safetensors")
    bf_path, bf = export(ckpt, "e16.safetensors", "--dtype", "bf16")
    want = {k: t[2] for k, t in safetensors(saved).items()}
    exact = all(t[0] == "F32" and not any(struct.unpack(f"<{len(t[2]) // 4}I", t[2])[i] & 0xFFFF
                                          for i in range(len(t[2]) // 4))
                for t in f32.values())
    ok = {k: t[2] for k, t in f32.items()} == want and exact
    print(f"  fsdp-ckpt export of the bf16-master checkpoint: F32, bitwise --save, bf16-exact: "
          f"{verdict(ok)}")
    # bf16 bits are the upper halves of the exact f32 values
    halves = {k: b"".join(t[2][i + 2:i + 4] for i in range(0, len(t[2]), 4))
              for k, t in f32.items()}
    ok = (all(t[0] == "BF16" and t[1] == f32[k][1] for k, t in bf.items())
          and {k: t[2] for k, t in bf.items()} == halves
          and os.path.getsize(bf_path) < 0.51 * os.path.getsize(f32_path))
    print(f"  --dtype bf16: BF16, the same values in half the bytes "
          f"({os.path.getsize(bf_path)} B vs {os.path.getsize(f32_path)} B): {verdict(ok)}")
    a, _ = mp.run(bindir, plan1, 1, 1, ["--init-from", f32_path])
    b, _ = mp.run(bindir, plan1, 1, 1, ["--init-from", bf_path])
    print(f"  --init-from the F32 and the BF16 export: the same first loss {a[0]:.6f}: "
          f"{verdict(a == b)}")
    # An f32-master checkpoint rounded to nearest even: PyTorch's cast.
    import torch
    w32_path, w32 = export(ckpt32, "w32.safetensors")
    _, w16 = export(ckpt32, "w16.safetensors", "--dtype", "bf16")
    moved = 0
    ok = True
    for k, (_, shape, data) in w32.items():
        x = torch.frombuffer(bytearray(data), dtype=torch.float32)
        y = torch.frombuffer(bytearray(w16[k][2]), dtype=torch.bfloat16)
        ok = ok and w16[k][0] == "BF16" and torch.equal(x.to(torch.bfloat16).view(torch.int16),
                                                        y.view(torch.int16))
        moved += int((y.float() != x).sum())
    ok = ok and moved > 0
    print(f"  --dtype bf16 of the f32-master checkpoint: torch's .to(bfloat16) bitwise "
          f"({moved} values rounded): {verdict(ok)}")
    r = subprocess.run([tool, "export", ckpt, os.path.join(tmp, "x.st"), "--dtype", "f16"],
                       capture_output=True, text=True)
    ok = r.returncode == 2 and "--dtype 'f16': expected f32 or bf16" in r.stderr
    print(f"  --dtype f16: exit {r.returncode}, named: {verdict(ok)}")


def check_text(bindir, tmp, tokens):
    failures = 0
    model = os.path.join(HERE, "..", "..", "examples", "gpt_small.mlir")
    args = ["--data", tokens, "--lr", "1e-3", "--schedule", "cosine", "--warmup", "10",
            "--threads", "2"]
    runs, depth = {}, None
    for label, pipeline in (("f32", "param-dtype=f32"),
                            ("f32 masters", "param-dtype=bf16 stochastic-rounding=true"),
                            ("bf16 stochastic", SR),
                            ("bf16 nearest", "param-dtype=bf16 master-dtype=bf16")):
        path = os.path.join(tmp, "text.plan")
        plan = mp.compile_plan(bindir, model, path, f"max-grad-norm=1.0 {pipeline}")
        if label == "bf16 stochastic":
            depth = mp.rounding_depth(plan)
        rows, _ = mp.run_rows(bindir, path, 1, 200, args)
        runs[label] = [r["loss"] for r in rows]
    rtol = depth * U
    print(f"(b) gpt_small on text, 200 steps: D = {depth}, tolerance D u = {rtol:.4f} on "
          f"50-step window means")
    f32 = mp.window_means(runs["f32"])
    means = mp.window_means(runs["bf16 stochastic"])
    for w, (a, b) in enumerate(zip(means, f32)):
        ok = rel(a, b) <= rtol
        failures += not ok
        print(f"  steps {w * 50 + 1:>3}..{(w + 1) * 50:<3} mean loss f32 {b:.4f} bf16 masters "
              f"stochastic {a:.4f} rel diff {rel(a, b):.4f}  {'ok' if ok else 'MISMATCH'}")
    last = sum(runs["bf16 stochastic"][150:]) / 50
    ok = last < 0.6 * math.log(256)
    failures += not ok
    print(f"  bf16 masters stochastic: last-window mean {last:.4f} < 0.6 ln 256: "
          f"{'ok' if ok else 'MISMATCH'}")
    dist = {k: sum(rel(a, b) for a, b in zip(mp.window_means(v), f32)) / 4
            for k, v in runs.items() if k != "f32"}
    final = {k: sum(v[190:]) / 10 for k, v in runs.items()}
    print("  measured: mean rel distance of the window means from f32: "
          + ", ".join(f"{k} {d:.5f}" for k, d in dist.items())
          + "; steps 191-200 mean loss: "
          + ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
    return failures


def check_cuda(bindir, tmp, runner):
    failures = 0
    model = sr.gpt(4, os.path.join(tmp, "g4.mlir"))
    for label, extra in (("f32 moments", ""), ("8-bit moments", " optimizer-state-dtype=8bit")):
        path = os.path.join(tmp, "c.plan")
        plan = mp.compile_plan(bindir, model, path, SR + extra)
        rtol = mp.rounding_depth(plan) * U

        cpu, cuda, graphs = cuda_runs(bindir, runner, path)
        err = max(rel(a, b) for a, b in zip(cuda, cpu))
        ok = len(cuda) == 6 and err <= rtol
        failures += not ok
        print(f"(c) bf16 masters, {label}, on cuda vs cpu, 6 steps: max rel diff {err:.2e} "
              f"(<= D u = {rtol:.4f})  {'ok' if ok else 'MISMATCH'}")
        ok = graphs == cuda
        failures += not ok
        print(f"  --cuda-graphs (steps 3-6 replayed) == eager bitwise: "
              f"{'ok' if ok else 'MISMATCH'}")
    return failures


def main():
    return main_modes(__doc__, "bf16 master checks pass",
                      {"shards": (0, check_shards), "text": (1, check_text),
                       "cuda": (1, check_cuda)})

if __name__ == "__main__":
    sys.exit(main())
