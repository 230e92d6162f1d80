"""Prints the swap-file layout of a plan compiled with offload-nvme=true
(test/lit/passes/offload-nvme.mlir checks the lines)."""
import json
import sys

p = json.load(open(sys.argv[1]))
bufs = p["buffers"]
A = p["swap_alignment"]
print("nvme_bytes", p["nvme_bytes"], "swap_alignment", A)


def blocks(b):
    """b's reserved span: whole blocks of swap_alignment from its offset,
    or None when it is not on a block."""
    if b["offset"] % A:
        return None
    return (b["offset"], b["offset"] + (b["bytes"] + A - 1) // A * A)


states = [bufs[s["buffer"]] for s in p["states"]]
inside = [b for b in states if b.get("space") == "nvme"]
spans = sorted(blocks(b) or (b["offset"], -1) for b in inside)
disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
within = all(hi <= p["nvme_bytes"] for _, hi in spans)
print(f"state buffers in nvme: {len(inside)} of {len(states)}"
      + (", on whole blocks" if all(blocks(b) for b in inside) else ", OFF BLOCKS")
      + (", disjoint" if disjoint else ", OVERLAPPING")
      + (", inside the file" if within else ", OUTSIDE the file"))
for inst in p["program"]:
    swaps = inst.get("attrs", {}).get("swap")
    if not swaps:
        continue
    ok = []
    for f, s, w in swaps:
        fb, sb = bufs[f], bufs[s]
        ok.append(fb.get("space") == "nvme" and sb.get("space") == "host"
                  and not sb["persistent"] and sb["bytes"] == fb["bytes"] and w
                  and s in inst["in"] and s in inst["out"]
                  and blocks(sb) is not None
                  and blocks(sb)[1] <= p["host_arena_bytes"])
    print(f"{inst['op']} swaps {len(swaps)}: " + (
        "file in nvme, staging host transient same bytes on whole blocks of the host "
        "arena, read and written, in the instruction's in and out" if all(ok)
        else f"BAD {swaps}"))
named = [k for k, inst in enumerate(p["program"])
         if any(bufs[i].get("space") == "nvme" for i in inst["in"] + inst["out"])]
print("no instruction names a swap-file buffer" if not named
      else f"instructions {named} name swap-file buffers")
m = p["memory"]
print("memory.nvme.state", m["nvme"]["state"], "file", m["nvme"]["file"],
      "memory.host.state", m["host"]["state"])
# Where each swapping instruction's reads are issued (nvme-read-ahead):
# after the step's first instruction, after the n-th swapping update, or
# at the instruction itself; and whether each staging buffer is live from
# there.
swapping = [k for k, inst in enumerate(p["program"]) if inst.get("attrs", {}).get("swap")]
where, live = [], True
for k in swapping:
    a = p["program"][k]["attrs"]
    at = a.get("swap_read_at")
    where.append("own" if at is None else "start" if at == 0
                 else f"update {swapping.index(at)}" if at in swapping else f"#{at}")
    live = live and all(bufs[st]["first"] <= (k if at is None else at) for _, st, _ in a["swap"])
print("reads:", ", ".join(where) + ";",
      "each staging live from its read" if live else "A STAGING LIVE AFTER ITS READ")
