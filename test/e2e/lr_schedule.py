#!/usr/bin/env python3
"""fsdp-run's learning-rate schedules against PyTorch's own schedulers.

usage: lr_schedule.py BIN_DIR WORK_DIR

For each schedule fsdp-run trains the small MLP for S steps with
--dump-dir and the script reads the learning rate of every step from the
dump's log.json. The oracle is torch.optim.lr_scheduler, one scheduler per
phase, each stepped from its phase's start (fsdp-run's step t counts from
1, so its warmup runs at lr t / W and the first step is not at 0):

  warmup (t <= W)  LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1)
                   after t - 1 steps;
  cosine           CosineAnnealingLR(T_max=S-W, eta_min=min_lr) after t - W;
  linear           LinearLR(1, min_lr/lr, total_iters=S-W) after t - W
                   (Hugging Face's get_linear_schedule_with_warmup, floored);
  wsd              the peak until step S - D, then LinearLR(1, min_lr/lr,
                   total_iters=D) after t - (S - D);
  wsd cosine       (--decay-shape cosine) the same, then
                   CosineAnnealingLR(T_max=D, eta_min=min_lr) after t - (S - D);
  wsd 1-sqrt       (--decay-shape 1-sqrt) the same, then LambdaLR with
                   min/lr + (1 - min/lr) (1 - sqrt(k / D)) after k = t - (S - D)
                   (Hagele et al. 2024's cooldown, written out);
  constant         the peak.

Tolerance: torch's schedulers are chainable (each value the previous one
times a ratio), so after k steps they carry at most a few roundings per
step, k * 8 * 2^-53 relative; with k <= S = 30 that is below 3e-14 of the
peak. fsdp-run evaluates the closed form (a few roundings), and log.json
prints doubles exactly. The bound used is 1e-12 of the peak: a schedule
off by one step moves some step by at least (lr - min_lr) / S, 1e10 times
more. The script also checks that each kind's values differ from the
others' (a schedule silently falling back to another would not pass), and
that the steps at the peak (the warmup's last, constant's, wsd's stable
phase) are the peak exactly.
"""
import json
import math
import os
import subprocess
import sys

import torch

S, W, LR, MIN_LR, D = 30, 4, 0.02, 0.002, 8


def torch_lrs(kind):
    def after(make, k):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=LR)
        sched = make(opt)
        for _ in range(k):
            opt.step()
            sched.step()
        return sched.get_last_lr()[0]

    out = []
    for t in range(1, S + 1):
        if t <= W:
            out.append(after(lambda o: torch.optim.lr_scheduler.LinearLR(
                o, start_factor=1.0 / W, end_factor=1.0, total_iters=W - 1), t - 1))
        elif kind == "constant":
            out.append(LR)
        elif kind == "cosine":
            out.append(after(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
                o, T_max=S - W, eta_min=MIN_LR), t - W))
        elif kind == "linear":
            out.append(after(lambda o: torch.optim.lr_scheduler.LinearLR(
                o, start_factor=1.0, end_factor=MIN_LR / LR, total_iters=S - W), t - W))
        elif t <= S - D:  # wsd's stable phase
            out.append(LR)
        elif kind == "wsd":
            out.append(after(lambda o: torch.optim.lr_scheduler.LinearLR(
                o, start_factor=1.0, end_factor=MIN_LR / LR, total_iters=D), t - (S - D)))
        elif kind == "wsd-cosine":
            out.append(after(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
                o, T_max=D, eta_min=MIN_LR), t - (S - D)))
        elif kind == "wsd-1-sqrt":
            r = MIN_LR / LR
            out.append(after(lambda o: torch.optim.lr_scheduler.LambdaLR(
                o, lambda k: r + (1 - r) * (1 - math.sqrt(k / D))), t - (S - D)))
    return out


def main():
    bindir, work = sys.argv[1:3]
    os.makedirs(work, exist_ok=True)
    plan = os.path.join(work, "mlp.plan")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
    mlir = os.path.join(work, "mlp.mlir")
    subprocess.run([sys.executable, os.path.join(src, "gen_models.py"), "mlp", "--hidden", "8",
                    "--blocks", "1", "--batch", "2", "-o", mlir], check=True)
    subprocess.run([os.path.join(bindir, "fsdp-opt"), mlir, "-o", os.devnull,
                    f"--fsdp-pipeline=optimizer=sgd plan={plan} report=false"], check=True)
    failures = 0
    seen = {}
    for kind in ("constant", "cosine", "linear", "wsd", "wsd-cosine", "wsd-1-sqrt"):
        dump = os.path.join(work, kind)
        base, _, shape = kind.partition("-")
        args = [os.path.join(bindir, "fsdp-run"), plan, "--threads", "1", "--quiet",
                "--steps", str(S), "--lr", str(LR), "--warmup", str(W),
                "--schedule", base, "--dump-dir", dump]
        if kind != "constant":
            args += ["--min-lr", str(MIN_LR)]
        if base == "wsd":
            args += ["--decay-steps", str(D)]
        if shape:
            args += ["--decay-shape", shape]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(dump, "log.json")) as f:
            ours = json.load(f)["lr"]
        ref = torch_lrs(kind)
        worst = max(abs(a - b) for a, b in zip(ours, ref))
        ok = len(ours) == S and worst <= 1e-12 * LR
        # After the warmup, constant and wsd's stable phase run at the peak
        # itself, bit for bit.
        stable = S if kind == "constant" else S - D if base == "wsd" else W
        if any(ours[t - 1] != LR for t in range(W, stable + 1)):
            print(f"FAIL {kind}: a step of its stable phase is not the peak {LR!r} exactly")
            ok = False
        seen[kind] = ours
        print(f"{'ok' if ok else 'FAIL':4} {kind:<10} {S} steps vs torch.optim.lr_scheduler: "
              f"max |diff| {worst:.2e} (bound {1e-12 * LR:.0e}); last lr {ours[-1]:.6g}")
        failures += not ok
    # A checkpoint in wsd's 1-sqrt decay (step S - D + 3), resumed: the
    # remaining steps' rates are the uninterrupted run's bit for bit (the
    # checkpoint records the shape); resumed with another shape, fsdp-run
    # says the schedule changed.
    ck = os.path.join(work, "wsd-ck")
    base = [os.path.join(bindir, "fsdp-run"), plan, "--threads", "1", "--quiet", "--lr", str(LR),
            "--warmup", str(W), "--schedule", "wsd", "--min-lr", str(MIN_LR), "--decay-steps",
            str(D)]
    at = S - D + 3
    subprocess.run(base + ["--steps", str(S), "--decay-shape", "1-sqrt", "--ckpt-dir", ck,
                           "--save-every", str(at)], check=True, stdout=subprocess.DEVNULL)
    ck = os.path.join(ck, f"step-{at:08d}")
    dump = os.path.join(work, "wsd-resumed")
    r = subprocess.run(base + ["--steps", str(S), "--decay-shape", "1-sqrt", "--resume", ck,
                               "--dump-dir", dump], check=True, capture_output=True, text=True)
    with open(os.path.join(dump, "log.json")) as f:
        resumed = json.load(f)["lr"]
    same = resumed == seen["wsd-1-sqrt"][at:] and "another schedule" not in r.stderr
    print(f"{'ok' if same else 'FAIL':4} wsd-1-sqrt resumed at step {at}: steps {at + 1}-{S} "
          f"{'equal' if same else 'differ from'} the uninterrupted run's bit for bit")
    failures += not same
    r = subprocess.run(base + ["--steps", str(S), "--resume", ck], capture_output=True,
                       text=True)
    noted = r.returncode == 0 and "another schedule" in r.stderr
    print(f"{'ok' if noted else 'FAIL':4} resumed with the linear shape: "
          f"{'the change is noted' if noted else 'no note: ' + r.stderr[-300:]}")
    failures += not noted
    kinds = list(seen)
    for i, a in enumerate(kinds):
        for b in kinds[i + 1:]:
            if max(abs(x - y) for x, y in zip(seen[a], seen[b])) < (LR - MIN_LR) / S:
                print(f"FAIL {a} and {b} give the same learning rates")
                failures += 1
    if failures:
        return 1
    print("all schedules match torch.optim.lr_scheduler")
    return 0


if __name__ == "__main__":
    sys.exit(main())
