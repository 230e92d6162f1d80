#!/usr/bin/env python3
"""More than one copy to the device in flight (offload-prefetch-depth).

fsdp-offload's prefetch issues each copy of offloaded storage to the
device on the copy stream where the copy `prefetch-depth` before it is
joined. At 1 (session 26) the next copy starts only when compute reaches
the previous copy's reader, so where compute runs long without reading
offloaded storage (the frozen blocks kept on the device in a fine-tune)
the copy stream idles, and with offload-next-step each copy waits on the
copy stream for its unit's update of the previous step, the copies queued
behind it with it. The memory-budget search now tries its fastest
prefetching schedules with 2 to 4 copies in flight and keeps a deeper one
where it predicts a faster step within the budget (the cost: one more
copy live on the device each).

Predicted only (h100 profile, passes/CostModel.cpp = fsdp-sim; not run on
a GPU): the Llama-2-7B-shaped fine-tune of docs/BENCHMARKS.md (32 layers,
width 4096, ctx 4096, vocab 32000, B=1, first 28 blocks frozen, AdamW,
bf16 compute, one rank) under each budget, the search as before (depth 1
pinned) and now (unpinned): what it chose, the step, the device arena,
and from fsdp-sim how long compute waited for copies and the copy stream
for host updates.

  bench/offload_prefetch_depth.py [BIN_DIR]
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIGS = [  # (frozen storage, budget, offload)
    ("f32", "80GiB", "all"),
    ("f32", "16GiB", "auto"),
    ("bf16", "24GiB", "auto"),
    ("bf16", "16GiB", "auto"),
    ("bf16", "15GiB", "auto"),
]


def main():
    bindir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "7bft.mlir")
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gen_models.py"), "gpt",
                        "--vocab", "32000", "--ctx", "4096", "--layers", "32", "--heads", "32",
                        "--width", "4096", "--batch", "1", "--frozen-layers", "28", "-o", model],
                       check=True)

        def compile_(tag, options):
            plan = os.path.join(tmp, tag + ".plan")
            subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw param-dtype=bf16 {options} "
                            f"plan={plan} report=false"], check=True)
            p = json.load(open(plan))
            sim = json.loads(subprocess.run(
                [sys.executable, os.path.join(ROOT, "tools", "fsdp-sim", "fsdp-sim"), plan,
                 "--profile", "h100", "--json"], check=True, capture_output=True,
                text=True).stdout)
            return p, sim[0] if isinstance(sim, list) else sim

        def chose(s):
            what = [s["offload"], s["recompute"]]
            if s["layers_per_unit"] != 1:
                what.append(f"{s['layers_per_unit']} layers a unit")
            if s["offload_next_step"]:
                what.append("next-step")
            what.append(f"{s['offload_prefetch_depth']} in flight" if s["offload_prefetch"]
                        else "no prefetch")
            return ", ".join(what)

        print("| frozen storage | budget | offload | depth 1 (pinned): chosen | step | "
              "arena | now: chosen | step | arena | ratio | copy wait 1 -> now | "
              "host wait 1 -> now |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for frozen, budget, off in CONFIGS:
            base = f"memory-budget={budget} offload={off}" + (
                " frozen-storage=compute" if frozen == "bf16" else "")
            tag = f"{frozen}-{budget}-{off}"
            (p1, m1), (pn, mn) = (compile_(f"{tag}-{t}", base + o) for t, o in
                                  (("1", " offload-prefetch-depth=1"), ("now", "")))
            s1, sn = p1["strategy"], pn["strategy"]
            gib = lambda p: p["arena_bytes"] / 2**30
            print(f"| {frozen} | {budget} | {off} | {chose(s1)} | "
                  f"{s1['predicted_step_s'] * 1e3:.1f} ms | {gib(p1):.2f} GiB | {chose(sn)} | "
                  f"{sn['predicted_step_s'] * 1e3:.1f} ms | {gib(pn):.2f} GiB | "
                  f"x{sn['predicted_step_s'] / s1['predicted_step_s']:.3f} | "
                  f"{m1['copy_exposed_ms']:.1f} -> {mn['copy_exposed_ms']:.1f} ms | "
                  f"{m1['host_exposed_ms']:.1f} -> {mn['host_exposed_ms']:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
