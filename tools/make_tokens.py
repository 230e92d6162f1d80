#!/usr/bin/env python3
"""Converts a text file to an llm.c token file with byte-level tokens.

  make_tokens.py INPUT.txt -o OUT.bin [--max-bytes N]
                 [--loss-mask MASK.bin [--prompt-fraction F]]

Header: 256 little-endian int32 (magic 20240520, version 1, token count,
zeros), then the tokens as little-endian uint16 (here: the bytes, vocab 256).

--loss-mask writes fsdp-run's --loss-mask for it, a token file of the same
length: 0 for a token that is not a target, 1 for one that is. Here a toy
prompt / response split: the first F (--prompt-fraction, default 0.5) of
each line's bytes are the "prompt" (0), the rest and the newline targets
(1), so windows keep uneven numbers of targets.
"""
import argparse
import struct
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input")
    ap.add_argument("-o", dest="out", required=True)
    ap.add_argument("--max-bytes", type=int, default=0)
    ap.add_argument("--loss-mask", help="also write a loss mask (see above)")
    ap.add_argument("--prompt-fraction", type=float, default=0.5)
    a = ap.parse_args()
    if not 0 <= a.prompt_fraction <= 1:
        ap.error("--prompt-fraction must be in [0, 1]")
    with open(a.input, "rb") as f:
        data = f.read()
    if a.max_bytes:
        data = data[:a.max_bytes]
    header = [20240520, 1, len(data)] + [0] * 253
    with open(a.out, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(data)}H", *data))
    if a.loss_mask:
        mask = []
        for line in data.split(b"\n"):
            prompt = int(len(line) * a.prompt_fraction)
            mask += [0] * prompt + [1] * (len(line) - prompt) + [1]  # + the newline
        mask = mask[:len(data)]  # the last line has no newline
        with open(a.loss_mask, "wb") as f:
            f.write(struct.pack("<256i", *header))
            f.write(struct.pack(f"<{len(mask)}H", *mask))
    return 0


if __name__ == "__main__":
    sys.exit(main())
