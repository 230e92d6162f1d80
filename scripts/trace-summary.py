#!/usr/bin/env python3
"""Sums an fsdp-run --trace (Chrome JSON) by op over the steps after the
first: where a step's time goes. With --plan, the ten slowest instructions
are named with their output shapes.
  python3 scripts/trace-summary.py trace.json [--plan x.plan] [--top 10]"""
import argparse
import collections
import json

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("trace")
ap.add_argument("--plan", default="")
ap.add_argument("--top", type=int, default=10)
a = ap.parse_args()
d = json.load(open(a.trace))
ev = d["traceEvents"] if isinstance(d, dict) else d
ev = [e for e in ev if e.get("ph") == "X" and e.get("tid") == 0]
steps = sorted({e["args"]["step"] for e in ev})
use = [e for e in ev if e["args"]["step"] != steps[0]] or ev
n = len({e["args"]["step"] for e in use})
by_op = collections.defaultdict(lambda: [0.0, 0])
by_inst = collections.defaultdict(float)
for e in use:
    by_op[e["name"]][0] += e["dur"] / n
    by_op[e["name"]][1] += 1
    by_inst[e["args"]["instruction"]] += e["dur"] / n
total = sum(v[0] for v in by_op.values())
print(f"{n} step(s), {total / 1000:.2f} ms of instructions per step")
print(f"{'op':28s} {'ms/step':>9s} {'share':>6s} {'count':>6s}")
for op, (us, c) in sorted(by_op.items(), key=lambda kv: -kv[1][0]):
    print(f"{op:28s} {us / 1000:9.3f} {100 * us / total:5.1f}% {c // n:6d}")
if a.plan:
    plan = json.load(open(a.plan))
    bufs = plan["buffers"]
    print(f"\nslowest {a.top} instructions")
    for i, us in sorted(by_inst.items(), key=lambda kv: -kv[1])[: a.top]:
        inst = plan["program"][i]
        shapes = " ".join(f"{bufs[o]['dtype']}{bufs[o]['shape']}" for o in inst["out"])
        ins = " ".join(f"{bufs[o]['dtype']}{bufs[o]['shape']}" for o in inst["in"])
        print(f"#{i:4d} {inst['op']:22s} {us / 1000:8.3f} ms  in {ins} -> {shapes}  {inst.get('attrs', {})}")
