#!/usr/bin/env python3
"""Activation recomputation changes memory, never results.

For every N in the list, every stage (and, at stage 3, reshard-after-forward
off, and gradient accumulation with per-micro-batch reduction), compiles
the model with recompute=none, unit and selective, runs each for S steps
on N ranks and checks that
  - the per-step losses and the final parameters are bitwise equal to
    those of recompute=none (recomputation runs the same kernels on the
    same inputs, so nothing may differ, not even in the last bit);
  - the recomputing plans do recompute (more instructions than none) and
    plan a lower peak per rank than none, with fewer activation bytes;
  - fsdp-run measures exactly the predicted arena high-water and peak
    live bytes for every plan.
The comparison is shown to detect a one-ulp-scale difference: once per
run, a plan run with a learning rate perturbed by 1e-6 (relative) must be
reported as different (if it is not, the script fails).

usage: recompute.py BIN_DIR mlp|gpt|llama OPTIMIZER STEPS N [N ...]
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from shard_equivalence import gen  # noqa: E402

# Rows per step over all ranks. The MLP's activations must outweigh its
# parameters, gradients and optimizer state for the peak to be where
# recomputation acts: 192 rows of width 32 do; 12 would not.
GLOBAL_BATCH = {"mlp": 192, "gpt": 12, "llama": 12}
LR = 1e-2


def read_raw(path):
    """Tensor name -> raw bytes of its data."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return {name: data[8 + n + meta["data_offsets"][0]:8 + n + meta["data_offsets"][1]]
            for name, meta in header.items() if name != "__metadata__"}


def compile_plan(bindir, model, plan, pipeline):
    subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                    f"--fsdp-pipeline={pipeline} plan={plan} report=false"], check=True)
    with open(plan) as f:
        return json.load(f)


def run(bindir, plan, save, n, steps, lr=LR):
    out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--steps", str(steps),
                          "--lr", repr(lr), "--json", "--threads", "1", "--save", save]
                         + (["--nproc", str(n)] if n > 1 else []),
                         check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    losses = [r["loss"] for r in rows if "step" in r]
    summary = [r for r in rows if r.get("summary")][-1]
    measured_ok = (summary["measured_high_water"] == summary["predicted_peak"]
                   and summary["measured_peak_live"] == summary["predicted_peak_live"])
    return losses, read_raw(save), measured_ok


def differs(a, b):
    """Names of what is not bitwise equal between two (losses, params)."""
    bad = []
    if len(a[0]) != len(b[0]) or any(
            struct.pack("<d", x) != struct.pack("<d", y) for x, y in zip(a[0], b[0])):
        bad.append("losses")
    bad += [name for name in a[1] if a[1][name] != b[1].get(name)]
    return bad


def control(bindir, plan, baseline, n, steps, tmp):
    """The comparison must see a tiny perturbation of the same run: `plan`
    run with the learning rate x (1 + 1e-6) must differ from `baseline`
    (its (losses, params)). Prints the verdict; True when detected."""
    losses, params, _ = run(bindir, plan, os.path.join(tmp, "control.st"), n, steps,
                            LR * (1 + 1e-6))
    caught = differs(baseline, (losses, params))
    print(f"  control: lr x (1 + 1e-6) differs in {len(caught)} of "
          f"{len(params) + 1} compared items {'(detected)' if caught else 'NOT DETECTED'}")
    return bool(caught)


def main():
    bindir, kind, optimizer = sys.argv[1], sys.argv[2], sys.argv[3]
    steps = int(sys.argv[4])
    worlds = [int(a) for a in sys.argv[5:]]
    failures = 0
    control_done = False
    kib = lambda b: f"{b / 1024:7.1f} KiB"
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{kind} ({optimizer}): recompute=unit|selective against none, "
              f"{steps} steps, bitwise")
        configs = [f"stage={s}" for s in range(4)] + [
            "stage=3 reshard-after-forward=false",
            "stage=3 grad-accum=2 accum-reduce=microbatch"]
        for n in worlds:
            # hpZ: resharding to an intermediate group of G ranks, 1 < G < N.
            hpz = [f"stage=3 reshard-after-forward={g}" for g in range(2, n) if n % g == 0]
            for config in configs + hpz:
                accum = 2 if "grad-accum=2" in config else 1
                model = os.path.join(tmp, f"b{n}x{accum}.mlir")
                if not os.path.exists(model):
                    gen(kind, GLOBAL_BATCH[kind] // n // accum, model)
                base = (f"optimizer={optimizer} max-grad-norm=1.0 world-size={n} "
                        f"{config}")
                results, plans = {}, {}
                measured_ok = True
                for policy in ("none", "unit", "selective"):
                    tag = os.path.join(tmp, f"n{n}-{config.replace(' ', '_')}-{policy}")
                    plans[policy] = compile_plan(bindir, model, tag + ".plan",
                                                 f"{base} recompute={policy}")
                    losses, params, ok = run(bindir, tag + ".plan", tag + ".st", n, steps)
                    results[policy] = (losses, params)
                    measured_ok &= ok
                if not control_done:
                    failures += not control(bindir, os.path.join(
                        tmp, f"n{n}-{config.replace(' ', '_')}-none.plan"), results["none"],
                        n, steps, tmp)
                    control_done = True
                mem = {p: plans[p]["memory"] for p in plans}
                size = {p: len(plans[p]["program"]) for p in plans}
                line = []
                ok = measured_ok
                for policy in ("unit", "selective"):
                    bad = differs(results["none"], results[policy])
                    recomputes = size[policy] > size["none"]
                    saves = (mem[policy]["peak"] < mem["none"]["peak"]
                             and mem[policy]["activations"] < mem["none"]["activations"])
                    ok &= not bad and recomputes and saves
                    line.append(f"{policy} +{size[policy] - size['none']:3d} instr "
                                f"peak {kib(mem[policy]['peak'])}"
                                + (f" DIFFERS in {', '.join(bad[:3])}" if bad else "")
                                + ("" if recomputes else " (nothing recomputed)")
                                + ("" if saves else " (no saving)"))
                failures += not ok
                print(f"  N={n} {config:<44} none peak {kib(mem['none']['peak'])} | "
                      + " | ".join(line)
                      + ("" if measured_ok else " | measured != predicted")
                      + f"  {'ok' if ok else 'MISMATCH'}")
    print("recomputation is bitwise invisible and saves memory" if not failures
          else f"FAIL: {failures} configuration(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
