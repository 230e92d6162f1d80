#!/usr/bin/env python3
"""reshard-after-forward true | G | false side by side (docs/BENCHMARKS.md):
for each GPT shape and world size, the h100 cost model's predicted step,
exposed communication and planned peak per rank when stage 3 reshards each
unit to the whole shard group after forward (true), to one node of G
ranks (hpZ: the backward's gathers stay on NVLink) or not at all (false).

  bench/reshard.py [--bin build/bin] [--ranks 64,512,1024] [--models gpt2,1.3b,7b]
                   [--node 8] [--extra "param-dtype=bf16"]

Models as in bench/budget.py; every other knob at its default (recompute
none, layers-per-unit 1, prefetch-depth 1); fsdp-opt ... simulate=true.
"""
import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from budget import MODELS, ROOT, gib, model_file, simulate  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--ranks", default="64,512,1024")
    ap.add_argument("--models", default="gpt2,1.3b,7b")
    ap.add_argument("--node", type=int, default=8)
    ap.add_argument("--extra", default="param-dtype=bf16")
    a = ap.parse_args()
    modes = ["true", str(a.node), "false"]
    print("| model | N | " + " | ".join(f"reshard={m}: step ms (exposed %), peak GiB"
                                        for m in modes) + " |")
    print("|---|---|" + "---|" * len(modes))
    with tempfile.TemporaryDirectory() as tmp:
        for key in a.models.split(","):
            label = MODELS[key][0]
            model = model_file(key, tmp)
            for n in [int(x) for x in a.ranks.split(",")]:
                cells = []
                for m in modes:
                    step, exp, peak = simulate(a.bin, model,
                                               f"world-size={n} optimizer=adamw "
                                               f"ranks-per-node={a.node} "
                                               f"reshard-after-forward={m} {a.extra}")
                    cells.append(f"{step:.1f} ({exp:.1f}), {gib(peak)}")
                print(f"| {label} | {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
