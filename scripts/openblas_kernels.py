#!/usr/bin/env python3
"""Whether two OPENBLAS_CORETYPEs of one libopenblas compute the same bits.

usage: openblas_kernels.py LIBOPENBLAS CORE_A CORE_B   (exit 0: the same)

scripts/coretype-sweep.sh reruns the suite once per OpenBLAS kernel the CPU
can execute, since a tolerance may hold on one kernel only. A rerun under a
core type whose arithmetic is another one's already run repeats it bit for
bit, and costs CI minutes. This tells such pairs apart from the library
itself, not from a list: each core type's dispatch table (`gotoblas_<CORE>`)
holds its blocking parameters and a pointer to each routine. Two core types
compute the same bits for our callers when

- every parameter of the table is equal (the blocking decides the order of
  every sum), and
- every routine that fsdp-run or the PyTorch oracle calls is the same code.
  fsdp-run calls cblas_sgemm / cblas_dgemm; Debian's libtorch_cpu imports
  sgemm_, sgemv_, sdot_, saxpy_, sscal_ and their double twins. So the
  table's [sd]gemm_* (the kernels, small-matrix kernels, packing copies and
  beta), [sd]gemv_*, [sd]dot_k, [sd]axpy_k and [sd]scal_k are compared,
  disassembled with addresses made relative (a rip-relative constant by its
  bytes; a table read by its slot; code reached through `lea`, a thread's
  work function, by its own disassembly up to the next symbol).

Two kinds of routine may differ and still compute the same bits: the gemm
packing copies (`*copy*`: they move values and round nothing) and `*_beta`
(C = beta * C: one multiply an element, correctly rounded on any
implementation, or a zero fill). They are reported, not counted.
"""

import re
import subprocess
import sys

WIDTH = {"zmm": 64, "ymm": 32, "xmm": 16}


def run(*args):
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


class Library:
    def __init__(self, path):
        self.path = path
        self.data = open(path, "rb").read()
        self.sections = []
        for line in run("readelf", "-SW", path).splitlines():
            m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+(\S+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)",
                         line)
            if m and m.group(2) != "NOBITS":
                self.sections.append((m.group(1), int(m.group(3), 16), int(m.group(4), 16),
                                      int(m.group(5), 16)))
        self.symbols, self.by_addr = {}, {}
        for line in run("nm", "-DS", path).splitlines():
            p = line.split()
            if len(p) == 4:
                addr, size = int(p[0], 16), int(p[1], 16)
                self.symbols[p[3]] = (addr, size)
                self.by_addr.setdefault(addr, []).append((p[3], size))
        self.starts = sorted(a for a, _ in self.symbols.values())
        self.relocs = {}
        for line in run("readelf", "-rW", path).splitlines():
            p = line.split()
            if len(p) >= 4 and re.fullmatch(r"[0-9a-f]{16}", p[0]):
                off = int(p[0], 16)
                if p[2] == "R_X86_64_RELATIVE":
                    self.relocs[off] = int(p[3], 16)
                elif p[2] in ("R_X86_64_64", "R_X86_64_GLOB_DAT") and len(p) >= 5:
                    m = re.search(r"([0-9a-f]{16})\s+\S+\s*\+\s*([0-9a-f]+)", line)
                    self.relocs[off] = int(m.group(1), 16) + int(m.group(2), 16)
        self.tables = {n: v for n, v in self.symbols.items() if n.startswith("gotoblas_")}

    def file_offset(self, addr):
        for _, base, off, size in self.sections:
            if base <= addr < base + size:
                return addr - base + off
        return None

    def bytes_at(self, addr, n):
        off = self.file_offset(addr)
        return None if off is None else self.data[off:off + n]

    def name_at(self, addr, core):
        names = [n for n, _ in self.by_addr.get(addr, [])]
        return names[0].replace("_" + core, "_<CORE>") if names else None

    def next_symbol(self, addr):
        for a in self.starts:  # sorted; a linear walk is fast enough here
            if a > addr:
                return a
        return addr + 4096

    def code(self, addr, end, core, seen):
        """Normalized disassembly of [addr, end)."""
        out = run("objdump", "-d", "--no-show-raw-insn", "--start-address=%d" % addr,
                  "--stop-address=%d" % end, self.path)
        lines = []
        for line in out.splitlines():
            m = re.match(r"\s*([0-9a-f]+):\s+(.*)", line)
            if not m:
                continue
            ins = m.group(2)
            target = re.search(r"#\s*([0-9a-f]+)", ins)
            if target and "(%rip)" in ins:
                t = int(target.group(1), 16)
                tag = self.operand(t, ins, core, seen)
                ins = re.sub(r"-?0x[0-9a-f]+\(%rip\)", tag, ins)
            ins = re.sub(r"#.*|<[^>]*>", "", ins)

            def relative(mm):
                v = int(mm.group(1), 16)
                if addr <= v < end:
                    return "L+%x" % (v - addr)
                return "CALL:%s" % (self.name_at(v, core) or "?")

            ins = re.sub(r"\b([0-9a-f]{5,})\b", relative, ins)
            lines.append(" ".join(ins.split()))
        return lines

    def operand(self, t, ins, core, seen):
        for name, (base, size) in self.tables.items():
            if base <= t < base + size:
                return "TABLE+%x" % (t - base)  # the slot, compared itself
        if t in self.relocs:
            return "PTR:%s" % (self.name_at(self.relocs[t], core) or "?")
        if ins.startswith("lea"):
            # code (a thread's work function) or a jump table
            sec = [s for s in self.sections if s[1] <= t < s[1] + s[3]]
            if sec and sec[0][0] == ".text" and t not in seen:
                seen.add(t)
                return "CODE{%s}" % ";".join(self.code(t, self.next_symbol(t), core, seen))
            return "ADDR"
        width = 8
        for reg, w in WIDTH.items():
            if "%" + reg in ins:
                width = w
        if re.match(r"v?(broadcastss|movss|[a-z]+ss)\b", ins):
            width = 4
        elif re.match(r"v?(broadcastsd|movsd|[a-z]+sd)\b", ins):
            width = 8
        data = self.bytes_at(t, width)
        return "DATA:%s" % (data.hex() if data is not None else "bss")

    def table(self, core):
        base, size = self.tables["gotoblas_" + core]
        params, routines = [], {}
        for i in range(0, size, 8):
            if base + i in self.relocs:
                target = self.relocs[base + i]
                routines[i] = (self.name_at(target, core), target)
            else:
                params.append((i, self.bytes_at(base + i, 8)))
        return params, routines


CALLED = re.compile(r"^[sd](gemm_|gemv_|dot_k|axpy_k|scal_k)")
EXEMPT = re.compile(r"copy|_beta_")


def compare(lib, a, b):
    pa, ra = lib.table(a)
    pb, rb = lib.table(b)
    differ, exempt = [], []
    if pa != pb:
        differ.append("parameters: slots %s" % [i for (i, x), (_, y) in zip(pa, pb) if x != y])
    for slot in sorted(ra):
        name_a, addr_a = ra[slot]
        name_b, addr_b = rb.get(slot, (None, None))
        if not name_a or not CALLED.match(name_a):
            continue
        if name_a != name_b:
            differ.append("slot %d: %s vs %s" % (slot, name_a, name_b))
            continue
        size_a = max(s for _, s in lib.by_addr[addr_a])
        size_b = max(s for _, s in lib.by_addr[addr_b])
        same = addr_a == addr_b or (
            lib.code(addr_a, addr_a + size_a, a, set()) == lib.code(addr_b, addr_b + size_b, b, set()))
        if not same:
            (exempt if EXEMPT.search(name_a + "_") else differ).append(name_a)
    return differ, exempt


def main():
    if len(sys.argv) != 4:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    lib = Library(sys.argv[1])
    a, b = sys.argv[2].upper(), sys.argv[3].upper()
    for core in (a, b):
        if "gotoblas_" + core not in lib.tables:
            print("%s has no core type %s" % (sys.argv[1], core), file=sys.stderr)
            return 2
    differ, exempt = compare(lib, a, b)
    if exempt:
        print("differ in code, not in bits (copies, beta): %s" % " ".join(exempt))
    if differ:
        print("%s and %s differ: %s" % (a, b, "; ".join(differ)))
        return 1
    print("%s computes %s's bits (parameters and the called routines' code)" % (b, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
