#!/usr/bin/env python3
"""Resharding on load (fsdp-run --resume with a plan for another layout,
docs/BENCHMARKS.md): what a rank reads, how long the load takes and the
host memory it needs, against the offline conversion (fsdp-ckpt reshard,
then a resume in the checkpoint's own layout) and a resume in the same
layout, measured in one run.

An MLP (AdamW) trains 2 steps on 2 CPU ranks at ZeRO-3 and checkpoints.
Then, ROUNDS times alternated, each case resumes it for one step:
  same      2 ranks, stage 3: each rank reads its own file (the baseline);
  4 ranks   4 ranks, stage 3, resharded on load;
  1 rank    1 rank, stage 0, resharded on load (the whole state);
  offline   fsdp-ckpt reshard to the 4-rank plan, then its resume.
Printed per case (medians): rank 0's load time (the JSON's
resumed.rank0_load_ms), the bytes rank 0 read and the checkpoint's size,
the run's wall time, and the peak resident memory of the largest process
(every rank and the launcher; the offline tool apart).

  bench/reshard_load.py [--bin build/bin] [--hidden 2048] [--blocks 4]
                        [--rounds 3] [--dir /tmp] [--cold]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from budget import GEN, ROOT  # noqa: E402

# Runs a command and prints, after its output, the peak resident set of
# the largest process it waited for (ranks are the launcher's children).
PEAK = ("import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:])\n"
        "print('peak-rss-kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(r.returncode)\n")


def measured(cmd):
    """(wall seconds, stdout lines, peak RSS in MiB) of `cmd`."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PEAK] + cmd, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    wall = time.perf_counter() - t
    peak = int(out[-1].split()[1]) / 1024
    return wall, out[:-1], peak


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="where the checkpoints go (the disk measured)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before every load (root only): reads "
                         "from the disk, not from memory")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="reshard-load-", dir=a.dir)
    opt, run, ckpt = (os.path.join(a.bin, t) for t in ("fsdp-opt", "fsdp-run", "fsdp-ckpt"))
    try:
        plans = {}
        # The global batch stays 32 rows.
        for tag, n, stage in (("n2s3", 2, 3), ("n4s3", 4, 3), ("n1s0", 1, 0)):
            mlir = os.path.join(work, tag + ".mlir")
            subprocess.run([sys.executable, GEN, "mlp", "--hidden", str(a.hidden), "--blocks",
                            str(a.blocks), "--batch", str(32 // n), "-o", mlir], check=True)
            plans[tag] = os.path.join(work, tag + ".plan")
            subprocess.run([opt, mlir, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw world-size={n} stage={stage} "
                            f"plan={plans[tag]} report=false"], check=True)
        ck = os.path.join(work, "ck")
        subprocess.run([run, plans["n2s3"], "--nproc", "2", "--threads", "1", "--steps", "2",
                        "--ckpt-dir", ck, "--quiet"], check=True, capture_output=True)

        def drop():
            if a.cold:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")

        def resume(tag, n, src):
            drop()
            cmd = [run, plans[tag], "--json", "--threads", "1", "--steps", "3", "--resume", src]
            cmd += ["--nproc", str(n)] if n > 1 else []
            wall, out, peak = measured(cmd)
            s = [json.loads(line) for line in out if line.startswith("{")][-1]["resumed"]
            return {"load": s["rank0_load_ms"], "read": s["rank0_read_bytes"],
                    "size": s["checkpoint_bytes"], "resharded": s["resharded"],
                    "wall": wall, "peak": peak}

        rows = {k: [] for k in ("same", "4 ranks", "1 rank", "offline")}
        convert, convert_peak = [], []
        for _ in range(a.rounds):
            rows["same"].append(resume("n2s3", 2, ck))
            rows["4 ranks"].append(resume("n4s3", 4, ck))
            rows["1 rank"].append(resume("n1s0", 1, ck))
            out = os.path.join(work, "ck4")
            shutil.rmtree(out, ignore_errors=True)
            drop()
            wall, _, peak = measured([ckpt, "reshard", ck, "--plan", plans["n4s3"], out])
            convert.append(wall * 1000)
            convert_peak.append(peak)
            r = resume("n4s3", 4, out)
            r["wall"] += wall
            rows["offline"].append(r)

        mib = 1 << 20
        med = statistics.median
        print(f"MLP hidden {a.hidden}, {a.blocks} blocks, AdamW; checkpoint of 2 CPU ranks at "
              f"ZeRO-3 in {a.dir}; page cache {'dropped before each load' if a.cold else 'warm'}; "
              f"{a.rounds} rounds alternated, medians\n")
        print("| resume | layout | rank 0 load ms | rank 0 read MiB | checkpoint MiB "
              "| run wall s (step 3 included) | peak RSS MiB (largest rank) |")
        print("|---|---|---|---|---|---|---|")
        for k, rs in rows.items():
            layout = {"same": "its own (2 ranks, stage 3)",
                      "4 ranks": "4 ranks, stage 3: resharded on load",
                      "1 rank": "1 rank, stage 0: resharded on load",
                      "offline": "fsdp-ckpt reshard to 4 ranks, then resume"}[k]
            assert all(r["resharded"] == (k in ("4 ranks", "1 rank")) for r in rs)
            print(f"| {k} | {layout} | {med(r['load'] for r in rs):.0f} | "
                  f"{med(r['read'] for r in rs) / mib:.1f} | {rs[0]['size'] / mib:.1f} | "
                  f"{med(r['wall'] for r in rs):.2f} | {med(r['peak'] for r in rs):.0f} |")
        print(f"\noffline conversion alone: {med(convert):.0f} ms, peak RSS "
              f"{med(convert_peak):.0f} MiB")
        same, four = med(r["load"] for r in rows["same"]), med(r["load"] for r in rows["4 ranks"])
        print(f"resharded on load to 4 ranks / same-layout load: {four / same:.2f}x the load time; "
              f"offline conversion + resume / resharded on load: "
              f"{med(r['wall'] for r in rows['offline']) / med(r['wall'] for r in rows['4 ranks']):.2f}x"
              f" the wall time")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
