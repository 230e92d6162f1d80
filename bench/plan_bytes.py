#!/usr/bin/env python3
"""Per-rank memory and communication of compiled plans, from the plan alone.

usage: plan_bytes.py PLAN [PLAN ...]

Prints the memory report (params, state, gradients and gathered parameters
at their largest, activations, planned peak) and the bytes each rank sends
per step by the ring algorithms' volume: all-gather and reduce-scatter
(N-1)/N x the whole buffer, all-reduce 2 (N-1)/N x buffer (groups of a 2-D
mesh are not told apart: this is for 1-D plans).
"""
import json
import sys


def main():
    mib = 2.0 ** 20
    for path in sys.argv[1:]:
        with open(path) as f:
            p = json.load(f)
        n, bufs = p["world_size"], p["buffers"]
        vol = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        for inst in p["program"]:
            op = inst["op"]
            if op == "all_gather":
                vol[op] += (n - 1) * bufs[inst["out"][0]]["bytes"] // n
            elif op == "reduce_scatter":
                vol[op] += (n - 1) * bufs[inst["in"][0]]["bytes"] // n
            elif op == "all_reduce":
                vol[op] += 2 * (n - 1) * bufs[inst["in"][0]]["bytes"] // n
        m = p["memory"]
        print(f"{path}: N={n} stage={p['stage']}")
        print(f"  params {m['params'] / mib:.1f} MiB  state {m['state'] / mib:.1f} MiB  "
              f"grads (max) {m['grads'] / mib:.1f} MiB  gathered (max) {m['comm'] / mib:.1f} MiB  "
              f"activations (max) {m['activations'] / mib / 1024:.2f} GiB  "
              f"peak {m['peak'] / mib / 1024:.2f} GiB")
        print("  sent per rank per step: " + "  ".join(
            f"{k} {v / mib:.1f} MiB" for k, v in vol.items()) +
            f"  total {sum(vol.values()) / mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
