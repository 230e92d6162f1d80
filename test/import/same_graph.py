#!/usr/bin/env python3
"""Do two fsdp-dialect models compute the same thing, op for op?

  same_graph.py A.mlir B.mlir

Each value is named by a hash of its op (mnemonic, attributes, types) and
of its operands' names, recursively (the function's arguments by position),
so the order ops are written in and their SSA names do not matter, but
every op, attribute, type and dataflow edge does. The parameter
declarations must agree in names, shapes and units (not initializers:
an imported model carries its values in a weights file). Prints SAME and
exits 0, or the first difference and exits 1. Plain Python 3.

One attribute is not compared: a cross-entropy's ignore_index = -100,
PyTorch's default, which fsdp-import writes and gen_models.py does not. On
labels that are never -100 (any token file without --loss-mask) it is the
same loss, bit for bit on the CPU (the kept count is the row count).
"""
import hashlib
import re
import sys


def parse(path):
    params, args, ops, ret = {}, [], {}, None
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("//"):
            continue
        m = re.match(r'fsdp\.param @"?([^" ]+)"? : (\S+) init\([^)]*\)(.*)', line)
        if m:
            params[m.group(1)] = (m.group(2), m.group(3).strip())
            continue
        if line.startswith("func.func"):
            args = re.findall(r"(%\w+): (\S+) \{fsdp\.role = \"(\w+)\"\}", line)
            continue
        m = re.match(r"(%[\w.]+) = (.*)", line)
        if m:
            text = m.group(2)
            if text.startswith("fsdp.cross_entropy"):
                text = re.sub(r"(, )?ignore_index = -100 : i64", "", text).replace(" {}", "")
                text = text.replace("{, ", "{")
            ops[m.group(1)] = text
        m = re.match(r"return (%[\w.]+)", line)
        if m:
            ret = m.group(1)
    return params, args, ops, ret


def digest(model):
    params, args, ops, ret = model
    names = {a: f"arg{i}:{t}:{role}" for i, (a, t, role) in enumerate(args)}
    memo = {}

    def h(v):
        stack = [v]
        while stack:
            x = stack[-1]
            if x in memo or x in names:
                stack.pop()
                continue
            deps = [d for d in re.findall(r"%[\w.]+", ops[x]) if d not in memo and d not in names]
            if deps:
                stack.extend(deps)
                continue
            text = re.sub(r"%[\w.]+", lambda m: names.get(m.group(0)) or memo[m.group(0)], ops[x])
            memo[x] = hashlib.sha1(text.encode()).hexdigest()[:16]
            stack.pop()
        return names.get(v) or memo[v]

    return h(ret), memo, ops


def main():
    a, b = parse(sys.argv[1]), parse(sys.argv[2])
    if a[0] != b[0]:
        only_a = sorted(set(a[0]) - set(b[0]))[:5]
        only_b = sorted(set(b[0]) - set(a[0]))[:5]
        diff = [n for n in a[0] if n in b[0] and a[0][n] != b[0][n]][:5]
        print(f"DIFFERENT parameters: only in A {only_a}, only in B {only_b}, "
              f"declared differently {[(n, a[0][n], b[0][n]) for n in diff]}")
        return 1
    if [(t, r) for _, t, r in a[1]] != [(t, r) for _, t, r in b[1]]:
        print(f"DIFFERENT arguments: {a[1]} vs {b[1]}")
        return 1
    ra, ma, oa = digest(a)
    rb, mb, ob = digest(b)
    if ra != rb:
        # the first op (in A's order) whose value B has no counterpart of
        hb = set(mb.values())
        for v, text in oa.items():
            if ma.get(v) not in hb:
                print(f"DIFFERENT: A's {v} = {text} has no equal in B")
                break
        return 1
    print(f"SAME: {len(ma)} values, {len(a[0])} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
