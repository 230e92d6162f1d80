#!/usr/bin/env python3
"""Converts a text file to an llm.c token file with byte-level tokens.

  make_tokens.py INPUT.txt -o OUT.bin [--max-bytes N]

Header: 256 little-endian int32 (magic 20240520, version 1, token count,
zeros), then the tokens as little-endian uint16 (here: the bytes, vocab 256).
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
    a = ap.parse_args()
    with open(a.input, "rb") as f:
        data = f.read()
    if a.max_bytes:
        data = data[:a.max_bytes]
    header = [20240520, 1, len(data)] + [0] * 253
    with open(a.out, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(data)}H", *data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
