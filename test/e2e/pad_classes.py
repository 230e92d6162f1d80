#!/usr/bin/env python3
"""Compares the per-step losses of two fsdp-run dumps (--dump-dir): the
padded LM head's run and the unpadded one's (test/lit/e2e/pad-classes.test).
The two plans compute the same loss and gradients; only the GEMMs'
blocking over 256 instead of 251 columns (their summation order) differs,
as between two backends, hence issue 9's cross-backend tolerance.
  pad_classes.py PADDED_DUMP UNPADDED_DUMP RTOL"""
import json
import os
import sys


def losses(d):
    with open(os.path.join(d, "log.json")) as f:
        return json.load(f)["losses"]


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    a, b, rtol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
    if len(a) != len(b) or not a:
        print(f"padded vs unpadded: {len(a)} and {len(b)} steps: MISMATCH")
        sys.exit(1)
    worst = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))
    ok = worst <= rtol
    print(f"padded vs unpadded: {len(a)} steps, max relative loss difference {worst:.3g} "
          f"(tolerance {rtol:g}): {'ok' if ok else 'MISMATCH'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
