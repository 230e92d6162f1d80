#!/usr/bin/env python3
"""Offload on one GPU, measured beside the cost model's prediction.

GPT-2 124M (T=1024) in bf16 at ZeRO-3 on one rank, the plans compiled by
scripts/gpu-pack.sh (offload_<tag>.plan):
  none       no offload (the stage-3 plan the others change)
  serial     offload=optimizer, every host update after the backward pass
  overlap    offload=optimizer, each update on the host stream beside it
  acts       offload-activations=true (copies on the copy stream)
  acts_unit  recompute=unit offload-activations=true
  clip       offload=optimizer max-grad-norm=1.0 (the updates after the
             backward pass: they need the global norm)
  clip_next  the same with offload-next-step=true (joined in the next
             step, beside its forward pass)
  clip_next_d4  the same with 4 copies to the device in flight
             (offload-prefetch-depth=4, one copy ahead in the others)
  nvme_direct, nvme_buffered  (with --nvme-dir and --tags) offload=optimizer
             offload-nvme=true (offload_nvme.plan): the AdamW moments in a
             swap file in --nvme-dir, read and written with O_DIRECT into
             the pinned host arena, or through the page cache (fsdp-run
             --nvme-io); the row adds how much of the file the page cache
             held at the end
  nvmep_direct  offload-nvme-params=true too (offload_nvmep.plan): the
             master shards in the swap file as well, each copy to the
             device reading them, O_DIRECT
Each plan runs --steps S (median ms/step of steps 3..S) R times,
alternating the plans; printed beside fsdp-sim's prediction of the same
plan on --profile (h100 by default: an H200's HBM is faster, so the
prediction is for an H100) and its ratio to `none`, with the device and
host peaks fsdp-run measured. --device cpu runs the same on CPU plans (a
rehearsal; the cost model then needs a CPU profile).

  python3 bench/offload_gpu.py --fsdp-run gpu-kit/bin/fsdp-run --plans gpu-kit/plans \\
      --sim gpu-kit/tools/fsdp-sim [--steps 10 --repeats 2] [--device cuda|cpu]
      [--tags none,nvme_direct,nvme_buffered,nvmep_direct --nvme-dir /tmp/fsdp-nvme]
"""
import argparse
import json
import statistics
import subprocess
import sys

TAGS = ("none", "serial", "overlap", "acts", "acts_unit", "clip", "clip_next", "clip_next_d4")
# Runs of another tag's plan with fsdp-run flags of their own.
RUNS = {"nvme_direct": ("nvme", ["--nvme-io", "direct"]),
        "nvme_buffered": ("nvme", ["--nvme-io", "buffered"]),
        "nvmep_direct": ("nvmep", ["--nvme-io", "direct"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp-run", required=True)
    ap.add_argument("--plans", required=True)
    ap.add_argument("--sim", required=True, help="tools/fsdp-sim")
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tags", default=",".join(TAGS))
    ap.add_argument("--nvme-dir", default=None, help="for the nvme_* tags")
    a = ap.parse_args()
    tags = a.tags.split(",")
    unknown = [t for t in tags if t not in TAGS and t not in RUNS]
    if unknown or (any(t in RUNS for t in tags) and not a.nvme_dir):
        sys.exit(f"offload_gpu.py: unknown tags {unknown}" if unknown else
                 "offload_gpu.py: the nvme_* tags need --nvme-dir")
    plans = {t: f"{a.plans}/offload_{RUNS[t][0] if t in RUNS else t}.plan" for t in tags}
    flags = {t: RUNS[t][1] + ["--nvme-dir", a.nvme_dir] if t in RUNS else [] for t in tags}
    times = {t: [] for t in tags}
    peaks, cached = {}, {}
    for _ in range(a.repeats):
        for t in tags:
            r = subprocess.run([a.fsdp_run, plans[t], "--device", a.device, "--steps",
                                str(a.steps), "--lr", "1e-4", "--json"] + flags[t],
                               capture_output=True, text=True)
            if r.returncode:
                print(f"{t}: fsdp-run failed (rc {r.returncode}): {r.stderr.strip()[-600:]}",
                      flush=True)
                continue
            lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
            steps = [x["ms"] for x in lines if "step" in x and "ms" in x and x["step"] >= 3]
            if steps:
                times[t].append(statistics.median(steps))
            s = [x for x in lines if x.get("summary")]
            if s:
                peaks[t] = (s[0]["measured_high_water"], s[0].get("measured_host_high_water", 0))
                if "nvme_cached_bytes" in s[0]:
                    cached[t] = (s[0]["nvme_io"], s[0]["nvme_cached_bytes"])
    pred = {}
    for t in tags:
        r = subprocess.run([sys.executable, a.sim, plans[t], "--profile", a.profile, "--json"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            d = json.loads(r.stdout)
            pred[t] = (d[0] if isinstance(d, list) else d)["step_ms"]
    base = statistics.median(times["none"]) if times.get("none") else None
    pbase = pred.get("none")
    print(f"{'plan':12s} {'measured':>10s} {'/ none':>7s} {'predicted':>10s} {'/ none':>7s}"
          f" {'device GiB':>10s} {'host GiB':>9s}")
    rows = []
    for t in tags:
        m = statistics.median(times[t]) if times[t] else None
        p = pred.get(t)
        dev, host = peaks.get(t, (None, None))
        row = {"plan": t, "measured_ms": m, "predicted_ms": p,
               "device_peak": dev, "host_peak": host, "runs_ms": times[t]}
        if t in cached:
            row["nvme_io"], row["nvme_cached_bytes"] = cached[t]
        rows.append(row)
        fmt = lambda x: f"{x:10.2f}" if x is not None else f"{'-':>10s}"
        ratio = lambda x, b: f"{x / b:7.3f}" if x is not None and b else f"{'-':>7s}"
        gib = lambda x: f"{x / 2**30:.2f}" if x is not None else "-"
        print(f"{t:12s} {fmt(m)} {ratio(m, base)} {fmt(p)} {ratio(p, pbase)}"
              f" {gib(dev):>10s} {gib(host):>9s}"
              + (f"  {cached[t][0]} I/O, {gib(cached[t][1])} GiB of the swap file in the "
                 f"page cache at the end" if t in cached else ""), flush=True)
    print(json.dumps({"device": a.device, "profile": a.profile, "rows": rows}))


if __name__ == "__main__":
    main()
