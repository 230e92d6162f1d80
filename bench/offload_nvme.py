#!/usr/bin/env python3
"""Optimizer state on disk (offload-nvme=true): what it saves and costs.

1. Measured on this machine (CPU ranks, stage 3, AdamW, --threads 1): ms/step
   of the MLP (hidden 256 x 8 blocks, batch 64; hidden 1024 x 4, batch 16)
   and the small GPT with the offloaded optimizer state in the host arena
   (offload=optimizer) and in the swap file (+ offload-nvme=true, the file in
   --nvme-dir), in one run (median of steps 2..S, alternating the plans R
   times); the host arena (predicted == measured), the swap file and its
   traffic per step. The state on disk runs both ways fsdp-run --nvme-io
   offers: buffered (pread / pwrite through the kernel's page cache: with
   memory free, the system calls and copies, not the drive) and direct
   (O_DIRECT: the drive; [Note: swap file I/O]), with how much of the swap
   file the page cache held at the end of each, the rates the direct swaps
   ran at, and fsdp-sim's prediction of the host and direct runs on this
   machine's profile (fsdp-run --calibrate --nvme-dir, direct). Then
   fsdp-run --calibrate's disk rates, both ways.
2. Predicted for H100 ranks (h100 profile: one PCIe Gen4 NVMe drive a GPU,
   6.5 GB/s read, 3.5 GB/s write): the Llama-2-7B-shaped GPT (32 x 4096,
   ctx 4096, bf16) at 1 and 8 ranks and the GPT-3-175B-shaped GPT at 16 and
   64, under memory-budget=80GiB, offloaded with the state in host memory
   and on disk: device peak, host arena, swap file, predicted step, the
   host stream's updates and the drive's swaps (each update's read runs
   beside the previous update and its write beside the next: [Note: swap
   pipeline]).

3. The same 7B shape on one rank under host-memory-budget 28 to 80 GiB with
   offload-nvme=auto: how many units' state the search keeps on disk
   (offload-nvme-units), the predicted step, the host arena and the file.

4. Reads ahead (offload-nvme-read-ahead=R: each update's state read from
   where the update R before it is issued, the first R from the step's
   start): measured on this machine, the MLP (hidden 256 x 8 blocks, batch
   64, one rank) with the state on disk at R = 0, 1, 2 in one run
   (alternating, median ms/step, the ratio to R = 0), the host arena and
   fsdp-sim's prediction on this machine's profile; predicted for the 7B
   shape on one H100 rank and the 175B shape on 64, R = 0, 1, 2 and the
   memory-budget search's choice.

5. Parameters on disk too (offload-nvme-params=true, ZeRO-Infinity's
   offload_param): measured on this machine, the MLP (hidden 256 x 8
   blocks, batch 64, one rank; hidden 1024 x 4, batch 16) with the state on
   disk and with the state and the master shards there, alternating
   (median ms/step, the ratio), the host arena (measured == predicted), the
   file's traffic per step and fsdp-sim's prediction on this machine's
   profile; predicted for the 7B shape on one H100 rank by
   host-memory-budget with offload-nvme-params=auto, and the 175B shape on
   64 ranks both ways.

  bench/offload_nvme.py [BIN_DIR] [--steps 12] [--repeats 3] [--nvme-dir DIR] [--skip-cpu]
                        [--parts 1,2,3,4,5]
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
GEN = os.path.join(ROOT, "examples", "gen_models.py")
SIM = os.path.join(ROOT, "tools", "fsdp-sim", "fsdp-sim")
VARIANTS = [("host", "offload=optimizer"), ("nvme", "offload=optimizer offload-nvme=true")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir", nargs="?", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--parts", default="1,2,3,4,5")
    a = ap.parse_args()
    parts = {int(x) for x in a.parts.split(",")}
    b = lambda t: os.path.join(a.bindir, t)
    gib = lambda x: x / 2**30

    def opt(model, pipeline, plan=None, check=True):
        r = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline={pipeline} report=true simulate=true"
                            + (f" plan={plan}" if plan else "")],
                           capture_output=True, text=True)
        if check and r.returncode:
            sys.exit(r.stderr)
        return r

    with tempfile.TemporaryDirectory() as tmp:
        swapdir = a.nvme_dir or os.path.join(tmp, "nvme")
        os.makedirs(swapdir, exist_ok=True)

        def gen(tag, *args):
            path = os.path.join(tmp, tag + ".mlir")
            subprocess.run([sys.executable, GEN] + list(args) + ["-o", path], check=True)
            return path

        if not a.skip_cpu and 1 in parts:
            fs = subprocess.run(["stat", "-f", "-c", "%T", swapdir], capture_output=True,
                                text=True).stdout.strip()
            print(f"1. CPU ranks, measured (--nvme-dir {swapdir}, file system {fs}; median "
                  f"ms/step of steps 2..{a.steps}, {a.repeats} alternating runs)")
            models = {"mlp": (gen("mlp", "mlp", "--hidden", "256", "--blocks", "8",
                                  "--batch", "64"), (1, 2)),
                      "mlp1k": (gen("mlp1k", "mlp", "--hidden", "1024", "--blocks", "4",
                                    "--batch", "16"), (1,)),
                      "gpt": (os.path.join(ROOT, "examples", "gpt_small.mlir"), (2,))}
            # This machine's profile at each rank count, with the swap
            # file's direct rates on this disk: the cost model's view of
            # the runs below (fsdp-sim).
            # Each also as the model had it before the drive's duplex
            # shares were measured: half and half.
            profiles, halves = {}, {}
            for n in sorted({n for _, ns in models.values() for n in ns}):
                out = subprocess.run([b("fsdp-run"), "--calibrate", "--nproc", str(n),
                                      "--nvme-dir", swapdir, "--nvme-io", "direct"],
                                     check=True, capture_output=True, text=True).stdout
                profiles[n] = os.path.join(tmp, f"cpu{n}.json")
                with open(profiles[n], "w") as f:
                    f.write(out[out.index("{"):])
                half = json.loads(out[out.index("{"):])
                half["compute"].update(nvme_duplex_read_share=0.5, nvme_duplex_write_share=0.5)
                halves[n] = os.path.join(tmp, f"cpu{n}-half.json")
                with open(halves[n], "w") as f:
                    json.dump(half, f)

            def sim(plan, n, half=False):
                out = subprocess.run([sys.executable, SIM, plan, "--profile",
                                      (halves if half else profiles)[n], "--json"],
                                     check=True, capture_output=True, text=True).stdout
                d = json.loads(out)
                return d[0] if isinstance(d, list) else d
            for name, (model, ns) in models.items():
                for n in ns:
                    plans = {}
                    for tag, opts in VARIANTS:
                        plans[tag] = os.path.join(tmp, f"{name}{n}{tag}.plan")
                        opt(model, f"optimizer=adamw world-size={n} stage=3 {opts}", plans[tag])
                    runs = {"host": (plans["host"], []),
                            "buffered": (plans["nvme"], ["--nvme-io", "buffered"]),
                            "direct": (plans["nvme"], ["--nvme-io", "direct"])}
                    times = {t: [] for t in runs}
                    last = {}
                    for _ in range(a.repeats):
                        for t, (plan, flags) in runs.items():
                            out = subprocess.run(
                                [b("fsdp-run"), plan, "--nproc", str(n), "--steps",
                                 str(a.steps), "--threads", "1", "--json", "--nvme-dir",
                                 swapdir] + flags,
                                check=True, capture_output=True, text=True).stdout
                            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
                            times[t] += [r["ms"] for r in rows if "step" in r and "ms" in r][1:]
                            last[t] = [r for r in rows if r.get("summary")][0]
                    med = {k: statistics.median(v) for k, v in times.items()}
                    h, d, db = last["host"], last["direct"], last["buffered"]
                    ok = all(s["measured_host_high_water"] == s["predicted_host_peak"] and
                             s["measured_high_water"] == s["predicted_peak"] for s in (h, d, db))
                    print(f"  {name} N={n}: host {med['host']:.2f}, nvme buffered "
                          f"{med['buffered']:.2f} (x{med['buffered'] / med['host']:.2f}), "
                          f"direct {med['direct']:.2f} ms/step (x{med['direct'] / med['host']:.2f}"
                          f"); host arena {h['predicted_host_peak']:,} -> "
                          f"{d['predicted_host_peak']:,} B "
                          f"(x{d['predicted_host_peak'] / h['predicted_host_peak']:.2f}); swap "
                          f"file {d['nvme_bytes']:,} B, {d['nvme_read_bytes_per_step']:,} B "
                          f"read and {d['nvme_written_bytes_per_step']:,} B written a step; in "
                          f"the page cache at the end: buffered {db['nvme_cached_bytes']:,} B, "
                          f"direct {d['nvme_cached_bytes']:,} B; measured == predicted: "
                          f"{'yes' if ok else 'NO'}")
                    # The cost model on this machine's calibrated profile
                    # against the measured steps, and the rates the direct
                    # swaps ran at against --calibrate's.
                    ph, pn = sim(plans["host"], n), sim(plans["nvme"], n)
                    p2 = sim(plans["nvme"], n, half=True)
                    with open(profiles[n]) as f:
                        c = json.load(f)["compute"]
                    print(f"    predicted on this machine's profile: host {ph['step_ms']:.2f} "
                          f"(measured x{med['host'] / ph['step_ms']:.2f}), nvme direct "
                          f"{pn['step_ms']:.2f} ms/step (measured x"
                          f"{med['direct'] / pn['step_ms']:.2f}; the drive busy "
                          f"{pn['swap_ms']:.2f} ms, {pn['swap_duplex_ms']:.2f} of them reading "
                          f"and writing at once at the calibrated duplex shares "
                          f"{c['nvme_duplex_read_share']:.2f} / "
                          f"{c['nvme_duplex_write_share']:.2f}; at half and half "
                          f"{p2['step_ms']:.2f} ms/step, measured x"
                          f"{med['direct'] / p2['step_ms']:.2f}, the drive {p2['swap_ms']:.2f} "
                          f"ms); the direct swaps ran at "
                          f"{d['nvme_read_bytes_per_step'] / d['nvme_read_seconds_per_step'] / 1e9:.2f}"
                          f" GB/s reading and "
                          f"{d['nvme_written_bytes_per_step'] / d['nvme_write_seconds_per_step'] / 1e9:.2f}"
                          f" GB/s writing (calibrated "
                          f"{c['nvme_read_bytes_per_s'] / 1e9:.2f} / "
                          f"{c['nvme_write_bytes_per_s'] / 1e9:.2f})")
            for io in ("buffered", "direct"):
                for n in (1, 2):
                    out = subprocess.run([b("fsdp-run"), "--calibrate", "--nproc", str(n),
                                          "--nvme-dir", swapdir, "--nvme-io", io],
                                         check=True, capture_output=True, text=True).stdout
                    c = json.loads(out[out.index("{"):])
                    print(f"  --calibrate --nvme-io {io}, {n} rank(s) at once: read "
                          f"{c['compute']['nvme_read_bytes_per_s'] / 1e9:.2f} GB/s, write "
                          f"{c['compute']['nvme_write_bytes_per_s'] / 1e9:.2f} GB/s a rank "
                          f"({c['nvme']['io']}); both at once "
                          f"{c['nvme']['duplex_read_bytes_per_s'] / 1e9:.2f} / "
                          f"{c['nvme']['duplex_write_bytes_per_s'] / 1e9:.2f} GB/s (shares "
                          f"{c['compute']['nvme_duplex_read_share']:.2f} / "
                          f"{c['compute']['nvme_duplex_write_share']:.2f})")

        l7 = gen("l7", "gpt", "--vocab", "32000", "--ctx", "4096", "--layers", "32",
                 "--heads", "32", "--width", "4096", "--batch", "1")
        g175 = gen("g175", "gpt", "--vocab", "50257", "--ctx", "2048", "--layers", "96",
                   "--heads", "96", "--width", "12288", "--batch", "1")

        def row(label, r):
            err = re.search(r"smallest peak reachable is ([0-9.]+ GiB)", r.stderr)
            if r.returncode:
                print(f"  {label:<26} no schedule fits; floor {err.group(1) if err else '?'}")
                return
            peak = re.search(r"arena \(planned peak\)\s+(\d+)", r.stderr)
            # (the search's own report names host arenas before the plan's)
            host = (re.findall(r"host arena\s+(\d+)", r.stderr) or [None])[-1]
            swap = re.search(r"swap file \(nvme\)\s+(\d+)", r.stderr)
            step = re.search(r"  step\s+([0-9.]+) ms", r.stderr)
            hostup = re.search(r"host updates\s+([0-9.]+) ms", r.stderr)
            drive = re.search(r"swaps \(drive busy\)\s+([0-9.]+) ms", r.stderr)
            chose = re.search(r"chose (.*)", r.stderr)
            print(f"  {label:<26} device {gib(int(peak.group(1))):6.2f} GiB  host "
                  f"{gib(int(host)) if host else 0:7.2f} GiB  swap file "
                  f"{gib(int(swap.group(1))) if swap else 0:7.2f} GiB  step "
                  f"{float(step.group(1)):10.1f} ms  host updates "
                  f"{float(hostup.group(1)) if hostup else 0:10.1f} ms  swaps "
                  f"{float(drive.group(1)) if drive else 0:10.1f} ms"
                  + (f"  [{chose.group(1)}]" if chose else ""))
        if 2 in parts:
            print("2. H100 ranks, predicted (h100 profile, memory-budget=80GiB)")
        for n in ((1, 8) if 2 in parts else ()):
            for tag, opts in VARIANTS:
                row(f"7B-shaped N={n} {tag}",
                    opt(l7, f"optimizer=adamw world-size={n} param-dtype=bf16 "
                            f"memory-budget=80GiB {opts}", check=False))
        for n in ((16, 64) if 2 in parts else ()):
            for tag, opts in VARIANTS:
                row(f"175B-shaped N={n} {tag}",
                    opt(g175, f"optimizer=adamw world-size={n} param-dtype=bf16 "
                              f"memory-budget=80GiB {opts}", check=False))

        if 3 in parts:
            print("3. The 7B shape on one rank by host-memory-budget (offload-nvme=auto: the "
                  "search keeps the fewest units' state on disk that fit, offload-nvme-units)")
        for hb in ((28, 40, 48, 56, 64, 80) if 3 in parts else ()):
            plan = os.path.join(tmp, f"l7-{hb}.plan")
            r = opt(l7, f"optimizer=adamw param-dtype=bf16 memory-budget=80GiB offload=optimizer "
                        f"offload-nvme=auto host-memory-budget={hb}GiB", plan,
                    check=False)
            if r.returncode:
                print(f"  {hb} GiB: nothing fits")
                continue
            with open(plan) as f:
                p = json.load(f)
            st = p["strategy"]
            print(f"  {hb:3d} GiB: "
                  + (f"state on disk, {st['offload_nvme_in_flight']} in flight, "
                     f"{st['offload_nvme_read_ahead']} read ahead, "
                     f"{st['offload_nvme_units']} units there" if st["offload_nvme"]
                     else "state in host memory")
                  + f"; step {1e3 * st['predicted_step_s']:.1f} ms, host arena "
                  f"{gib(p['host_arena_bytes']):.2f} GiB, swap file "
                  f"{gib(p.get('nvme_bytes', 0)):.2f} GiB")

        if 5 in parts:
            params_on_disk(a, b, opt, gen, row, swapdir, tmp, l7, g175)
        if 4 not in parts:
            return
        print("4. Reads ahead (offload-nvme-read-ahead=R, the state on disk)")
        aheads = (0, 1, 2)
        if not a.skip_cpu:
            model = gen("mlp-ra", "mlp", "--hidden", "256", "--blocks", "8", "--batch", "64")
            out = subprocess.run([b("fsdp-run"), "--calibrate", "--nvme-dir", swapdir],
                                 check=True, capture_output=True, text=True).stdout
            prof = os.path.join(tmp, "cpu1-ra.json")
            with open(prof, "w") as f:
                f.write(out[out.index("{"):])
            plans = {}
            for r in aheads:
                plans[r] = os.path.join(tmp, f"mlp-ra{r}.plan")
                opt(model, "optimizer=adamw world-size=1 stage=3 offload=optimizer "
                           f"offload-nvme=true offload-nvme-read-ahead={r}", plans[r])
            med, last = alternate(a, b, plans, swapdir)
            for r in aheads:
                s = last[r]
                d = json.loads(subprocess.run([sys.executable, SIM, plans[r], "--profile", prof,
                                               "--json"], check=True, capture_output=True,
                                              text=True).stdout)
                d = d[0] if isinstance(d, list) else d
                ok = (s["measured_host_high_water"] == s["predicted_host_peak"] and
                      s["measured_high_water"] == s["predicted_peak"])
                print(f"  mlp 256x8 N=1 R={r}: {med[r]:.2f} ms/step (x{med[r] / med[0]:.3f} of "
                      f"R=0), host arena {s['predicted_host_peak']:,} B (measured == predicted: "
                      f"{'yes' if ok else 'NO'}), {s.get('nvme_io', '?')} I/O; predicted on "
                      f"this machine's profile {d['step_ms']:.2f} ms/step (measured "
                      f"x{med[r] / d['step_ms']:.2f}), the drive busy {d['swap_ms']:.2f} ms")
        for label, model, n in (("7B-shaped N=1", l7, 1), ("175B-shaped N=64", g175, 64)):
            for r in aheads + (None,):  # (None: the search chooses)
                row(f"{label} R={'search' if r is None else r}",
                    opt(model, f"optimizer=adamw world-size={n} param-dtype=bf16 "
                               f"memory-budget=80GiB offload=optimizer offload-nvme=true"
                               + (f" offload-nvme-read-ahead={r}" if r is not None else ""),
                        check=False))


def alternate(a, b, plans, swapdir):
    """Runs each of `plans` ({key: plan}) a.steps steps on one rank, in
    turn, a.repeats times: ({key: the median ms/step of steps 2..}, {key:
    the last run's summary row})."""
    times = {k: [] for k in plans}
    last = {}
    for _ in range(a.repeats):
        for k, plan in plans.items():
            out = subprocess.run(
                [b("fsdp-run"), plan, "--steps", str(a.steps), "--threads", "1", "--json",
                 "--nvme-dir", swapdir], check=True, capture_output=True, text=True).stdout
            rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
            times[k] += [x["ms"] for x in rows if "step" in x and "ms" in x][1:]
            last[k] = [x for x in rows if x.get("summary")][0]
    return {k: statistics.median(v) for k, v in times.items()}, last


def params_on_disk(a, b, opt, gen, row, swapdir, tmp, l7, g175):
    """Part 5: the master shards on disk too (offload-nvme-params)."""
    gib = lambda x: x / 2**30
    print("5. Parameters on disk too (offload-nvme-params: the master shards in the swap file)")
    if not a.skip_cpu:
        out = subprocess.run([b("fsdp-run"), "--calibrate", "--nvme-dir", swapdir],
                             check=True, capture_output=True, text=True).stdout
        prof = os.path.join(tmp, "cpu1-params.json")
        with open(prof, "w") as f:
            f.write(out[out.index("{"):])
        models = {"mlp 256x8": gen("mlp-p", "mlp", "--hidden", "256", "--blocks", "8",
                                   "--batch", "64"),
                  "mlp 1024x4": gen("mlp1k-p", "mlp", "--hidden", "1024", "--blocks", "4",
                                    "--batch", "16")}
        for name, model in models.items():
            plans = {}
            for tag, extra in (("state", "false"), ("state+params", "true")):
                plans[tag] = os.path.join(tmp, f"{name.replace(' ', '')}-{extra}.plan")
                opt(model, "optimizer=adamw world-size=1 stage=3 offload=optimizer "
                           f"offload-nvme=true offload-nvme-params={extra}", plans[tag])
            med, last = alternate(a, b, plans, swapdir)
            for t, plan in plans.items():
                s = last[t]
                d = json.loads(subprocess.run([sys.executable, SIM, plan, "--profile", prof,
                                               "--json"], check=True, capture_output=True,
                                              text=True).stdout)
                d = d[0] if isinstance(d, list) else d
                ok = (s["measured_host_high_water"] == s["predicted_host_peak"] and
                      s["measured_high_water"] == s["predicted_peak"])
                print(f"  {name} N=1 {t:<12}: {med[t]:7.2f} ms/step (x{med[t] / med['state']:.3f})"
                      f", host arena {s['predicted_host_peak']:,} B (measured == predicted: "
                      f"{'yes' if ok else 'NO'}), {s['nvme_read_bytes_per_step']:,} B read / "
                      f"{s['nvme_written_bytes_per_step']:,} B written a step, "
                      f"{s.get('nvme_io', '?')} I/O; predicted {d['step_ms']:.2f} ms/step "
                      f"(measured x{med[t] / d['step_ms']:.2f})")
    print("  7B shape, one H100 rank, by host-memory-budget (offload-nvme=auto "
          "offload-nvme-params=auto)")
    for hb in (8, 12, 16, 20, 24, 28):
        plan = os.path.join(tmp, f"l7p-{hb}.plan")
        r = opt(l7, "optimizer=adamw param-dtype=bf16 memory-budget=80GiB offload=optimizer "
                    f"offload-nvme=auto offload-nvme-params=auto host-memory-budget={hb}GiB",
                plan, check=False)
        if r.returncode:
            floor = re.search(r"smallest host arena reachable is ([0-9.]+ GiB)", r.stderr)
            print(f"  {hb:3d} GiB: nothing fits (the smallest host arena: "
                  f"{floor.group(1) if floor else '?'})")
            continue
        with open(plan) as f:
            p = json.load(f)
        st = p["strategy"]
        print(f"  {hb:3d} GiB: "
              + (f"state{' and master shards' if st.get('offload_nvme_params') else ''} on "
                 f"disk, {st['offload_nvme_in_flight']} in flight, "
                 f"{st['offload_nvme_read_ahead']} read ahead, {st['offload_nvme_units']} units"
                 if st["offload_nvme"] else "state in host memory")
              + f"; step {1e3 * st['predicted_step_s']:.1f} ms, host arena "
              f"{gib(p['host_arena_bytes']):.2f} GiB, swap file "
              f"{gib(p.get('nvme_bytes', 0)):.2f} GiB")
    for extra in ("false", "true"):
        row(f"175B-shaped N=64 params {extra}",
            opt(g175, "optimizer=adamw world-size=64 param-dtype=bf16 memory-budget=80GiB "
                      f"offload=optimizer offload-nvme=true offload-nvme-params={extra}",
                check=False))


if __name__ == "__main__":
    main()
