#!/usr/bin/env python3
"""Sums an ncu --csv --page raw dump of gpu__time_duration.sum (scripts/
gpu-ncu.sh's kernels.csv) per kernel name over the last training step (the
kernels after the AdamW launches that end the step before), largest first.

  ncu-summary.py kernels.csv [--top N]
"""
import argparse
import collections
import csv
import re

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--top", type=int, default=40)
args = ap.parse_args()
with open(args.csv) as f:
    rows = list(csv.reader(l for l in f if l.startswith('"')))
hdr = rows[0]
ni, ti = hdr.index("Kernel Name"), hdr.index("gpu__time_duration.sum")
unit = rows[1][ti]
data = [(r[ni], float(r[ti].replace(",", ""))) for r in rows[2:]]
adam = [i for i, (n, _) in enumerate(data) if "adamw" in n.lower()]
# The last step starts after the AdamW launches that end the one before.
ends = [i for j, i in enumerate(adam[:-1]) if adam[j + 1] != i + 1]
start = ends[-1] + 1 if ends else 0
step = data[start:]
scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}.get(unit, 1e-6)
sums, counts = collections.defaultdict(float), collections.Counter()
for n, t in step:
    short = re.sub(r"\(.*", "", n)[:90]
    sums[short] += t * scale
    counts[short] += 1
total = sum(sums.values())
print(f"last step: {len(step)} kernels, {total:.2f} ms of kernel time (unit {unit})")
for n, t in sorted(sums.items(), key=lambda x: -x[1])[: args.top]:
    print(f"{t:8.3f} ms {100 * t / total:5.1f}%  x{counts[n]:<4d} {n}")
