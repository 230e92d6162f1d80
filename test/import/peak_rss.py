#!/usr/bin/env python3
"""Runs a command and checks its peak resident memory.

  peak_rss.py LIMIT_MIB COMMAND [ARG ...]

Prints "peak RSS: N MiB (limit L MiB): WITHIN" or "...: OVER" and exits 1
if the command failed or went over. The peak is the kernel's (getrusage of
the waited-for child: ru_maxrss, in KiB on Linux). Plain Python 3.
"""
import resource
import subprocess
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    limit = float(sys.argv[1])
    rc = subprocess.call(sys.argv[2:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    verdict = "WITHIN" if peak <= limit else "OVER"
    print(f"peak RSS: {peak:.0f} MiB (limit {limit:.0f} MiB): {verdict}")
    if rc != 0:
        print(f"the command failed (exit {rc})")
        return 1
    return 0 if verdict == "WITHIN" else 1


if __name__ == "__main__":
    sys.exit(main())
