#!/usr/bin/env python3
"""Optimizer offload (offload=optimizer): what it saves and what it costs.

1. Measured on this machine (CPU ranks, both arenas host memory): ms/step
   of the MLP (hidden 256 x 8 blocks, batch 64) and the small GPT at
   N = 1, 2 and 4, and the MLP of 1024 x 4 at batch 16 at N = 1 and 2, stage 3, without and with offload, in one run (median of
   steps 2..S, alternating the plans R times): without offload, offloaded
   with the host updates after the backward pass (offload-overlap=false)
   and offloaded with them beside it (the default); the device arena
   (predicted == measured) and the host arena.
2. Predicted for H100 ranks (the h100 profile: PCIe 64 GB/s per direction,
   host memory 307/4 GB/s per rank): planned device peak, host arena and
   predicted step of GPT-2 124M (bf16, 8 ranks, stage 3), and of the
   Llama-2-7B-shaped GPT (32 x 4096, ctx 4096, bf16) and the
   GPT-3-175B-shaped GPT under memory-budget=80GiB, without offload and
   offloaded with the host updates after / beside the backward pass: the
   schedule the search picks, or the floor when none fits.

  bench/offload.py [BIN_DIR] [--steps 12] [--repeats 3] [--skip-cpu]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# (label, pipeline options): no offload; offloaded, updates after the
# backward pass; offloaded, updates beside it (the default).
VARIANTS = [("none", "offload=none"),
            ("serial", "offload=optimizer offload-overlap=false"),
            ("optimizer", "offload=optimizer")]
GEN = os.path.join(ROOT, "examples", "gen_models.py")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir", nargs="?", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-cpu", action="store_true")
    a = ap.parse_args()
    b = lambda t: os.path.join(a.bindir, t)
    gib = lambda x: x / 2**30

    def opt(model, pipeline, plan=None, check=True):
        args = [b("fsdp-opt"), model, "-o", os.devnull,
                f"--fsdp-pipeline={pipeline} report=true simulate=true"
                + (f" plan={plan}" if plan else "")]
        r = subprocess.run(args, capture_output=True, text=True)
        if check and r.returncode:
            sys.exit(r.stderr)
        return r

    with tempfile.TemporaryDirectory() as tmp:
        def gen(tag, *args):
            path = os.path.join(tmp, tag + ".mlir")
            subprocess.run([sys.executable, GEN] + list(args) + ["-o", path], check=True)
            return path

        if not a.skip_cpu:
            print("1. CPU ranks, measured (median ms/step of steps 2..; device arena "
                  "predicted == measured; host arena)")
            # (the MLP of 1024 x 4 at batch 16: an update as long as a
            # third of the step, what the overlap is for)
            models = {"mlp": (gen("mlp", "mlp", "--hidden", "256", "--blocks", "8",
                                  "--batch", "64"), (1, 2, 4)),
                      "gpt": (os.path.join(ROOT, "examples", "gpt_small.mlir"), (1, 2, 4)),
                      "mlp1k": (gen("mlp1k", "mlp", "--hidden", "1024", "--blocks", "4",
                                    "--batch", "16"), (1, 2))}
            for name, (model, ns) in models.items():
                for n in ns:
                    plans = {}
                    for off, opts in VARIANTS:
                        plans[off] = os.path.join(tmp, f"{name}{n}{off}.plan")
                        opt(model, f"optimizer=adamw world-size={n} stage=3 {opts}",
                            plans[off])
                    times = {off: [] for off in plans}
                    last = {}
                    for _ in range(a.repeats):
                        for off in plans:
                            out = subprocess.run(
                                [b("fsdp-run"), plans[off], "--nproc", str(n), "--steps",
                                 str(a.steps), "--threads", "1", "--json"],
                                check=True, capture_output=True, text=True).stdout
                            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
                            times[off] += [r["ms"] for r in rows if "step" in r and "ms" in r][1:]
                            last[off] = [r for r in rows if r.get("summary")][0]
                    med = {k: statistics.median(v) for k, v in times.items()}
                    s0, s1 = last["none"], last["optimizer"]
                    ok = all(s["measured_high_water"] == s["predicted_peak"] and
                             s["measured_host_high_water"] == s["predicted_host_peak"]
                             for s in (s1, last["serial"]))
                    print(f"  {name} N={n}: {med['none']:.1f} -> serial {med['serial']:.1f} "
                          f"(x{med['serial'] / med['none']:.2f}), overlapped "
                          f"{med['optimizer']:.1f} ms/step "
                          f"(x{med['optimizer'] / med['none']:.2f}); device "
                          f"{s0['predicted_peak']:,} -> {s1['predicted_peak']:,} B "
                          f"(x{s1['predicted_peak'] / s0['predicted_peak']:.2f}), host "
                          f"{s1['predicted_host_peak']:,} B; measured == predicted: "
                          f"{'yes' if ok else 'NO'}")

        print("2. H100 ranks, predicted (h100 profile)")
        def row(label, r):
            err = re.search(r"smallest peak reachable is ([0-9.]+ GiB)", r.stderr)
            if r.returncode:
                print(f"  {label:<34} no schedule fits; floor {err.group(1) if err else '?'}")
                return
            peak = re.search(r"arena \(planned peak\)\s+(\d+)", r.stderr)
            host = re.search(r"host arena\s+(\d+)", r.stderr)
            step = re.search(r"step\s+([0-9.]+) ms", r.stderr)
            chose = re.search(r"chose (.*)", r.stderr)
            print(f"  {label:<34} device {gib(int(peak.group(1))):6.2f} GiB  host "
                  f"{gib(int(host.group(1))) if host else 0:7.2f} GiB  step "
                  f"{float(step.group(1)):10.2f} ms" + (f"  [{chose.group(1)}]" if chose else ""))
        gpt2 = os.path.join(ROOT, "examples", "gpt2.mlir")
        for off, opts in VARIANTS:
            row(f"GPT-2 124M N=8 {off}",
                opt(gpt2, f"optimizer=adamw world-size=8 stage=3 param-dtype=bf16 {opts}",
                    check=False))
        l7 = gen("l7", "gpt", "--vocab", "32000", "--ctx", "4096", "--layers", "32",
                 "--heads", "32", "--width", "4096", "--batch", "1")
        for n in (1, 2, 8):
            for off, opts in VARIANTS:
                row(f"7B-shaped N={n} {off}",
                    opt(l7, f"optimizer=adamw world-size={n} param-dtype=bf16 "
                            f"memory-budget=80GiB {opts}", check=False))
        g175 = gen("g175", "gpt", "--vocab", "50257", "--ctx", "2048", "--layers", "96",
                   "--heads", "96", "--width", "12288", "--batch", "1")
        for n in (16, 64):
            for off, opts in VARIANTS:
                row(f"175B-shaped N={n} {off}",
                    opt(g175, f"optimizer=adamw world-size={n} param-dtype=bf16 "
                              f"memory-budget=80GiB {opts}", check=False))


if __name__ == "__main__":
    main()
