#!/usr/bin/env python3
"""Rewrites a CUDA source (.cu / .cuh) into C++ for the CPU emulator.

Two constructs of CUDA C++ are not C++ and cannot be given meaning by a
header (test/cudaemu/Emu.h does the rest):
  kernel<<<grid, block[, smem[, stream]]>>>(args...);
      -> ::cudaemu::launch(ID, grid, block, smem, stream,
                           [=](auto... a_) { kernel(a_...); }, args...);
     (ID names the kernel for cudaFuncSetAttribute where the launch asks
     for dynamic shared memory; the kernel is then nameable)
  extern __shared__ [__align__(n)] T name[];
      -> T *name = reinterpret_cast<T *>(::cudaemu::dynamicShared());
Line numbers are kept (a launch that spans lines is rewritten onto its
first line and padded with newlines), so compiler errors and the
emulator's messages point at the original source.

usage: emu_transform.py IN OUT
"""
import re
import sys


def split_top(s):
    """Splits s at commas outside (), <>, [] and {}."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def matching_paren(text, i):
    """Index of the ')' closing the '(' at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    raise SystemExit(f"emu_transform: unbalanced parentheses after offset {i}")


LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)\s*<<<")
SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w:]+(?:\s+[\w:]+)*)\s+(\w+)\s*\[\s*\]\s*;")


def rewrite(text):
    out, pos = [], 0
    for m in LAUNCH.finditer(text):
        if m.start() < pos:
            continue
        kernel = m.group(1)
        cfg_end = text.index(">>>", m.end())
        cfg = split_top(text[m.end():cfg_end])
        if not 2 <= len(cfg) <= 4:
            raise SystemExit(f"emu_transform: launch config of {kernel}: {cfg}")
        cfg += ["0", "0"][: 4 - len(cfg)]
        open_paren = text.index("(", cfg_end)
        close = matching_paren(text, open_paren)
        # A // comment inside the arguments would swallow the rest once
        # the launch is joined onto one line.
        args = re.sub(r"//[^\n]*", "", text[open_paren + 1:close]).strip()
        smem_named = cfg[2] not in ("0", "0u")
        ident = f"::cudaemu::fnId({kernel})" if smem_named else "nullptr"
        call = (f"::cudaemu::launch({ident}, {cfg[0]}, {cfg[1]}, {cfg[2]}, {cfg[3]}, "
                f"[=](auto... a_) {{ {kernel}(a_...); }}{', ' + args if args else ''})")
        span = text[m.start():close + 1]
        out.append(text[pos:m.start()])
        out.append(call.replace("\n", " ") + "\n" * span.count("\n"))
        pos = close + 1
    out.append(text[pos:])
    text = "".join(out)
    return SHARED.sub(
        lambda m: f"{m.group(1)} *{m.group(2)} = reinterpret_cast<{m.group(1)} *>"
                  f"(::cudaemu::dynamicShared());", text)


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        text = f.read()
    result = rewrite(text)
    if "<<<" in result:
        raise SystemExit(f"emu_transform: {sys.argv[1]}: a launch was not rewritten")
    with open(sys.argv[2], "w") as f:
        f.write(f'#line 1 "{sys.argv[1]}"\n' + result)


if __name__ == "__main__":
    main()
