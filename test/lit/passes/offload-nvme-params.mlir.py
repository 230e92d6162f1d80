"""Prints where a plan compiled with offload-nvme-params=true keeps the
units' storage and how it reaches the device
(test/lit/passes/offload-nvme-params.mlir checks the lines)."""
import json
import sys

p = json.load(open(sys.argv[1]))
bufs = p["buffers"]
A = p["swap_alignment"]


def root(b):
    return b.get("alias_of", b["id"])


units = [u for u in p["units"]]
for u in units:
    b = bufs[u["buffer"]]
    print(f"unit {u['name']}: {b.get('space', 'device')}" +
          (f" at {b['offset']} ({b['offset'] % A == 0 and 'on a block' or 'OFF A BLOCK'}), "
           f"{b['bytes']} B" if b.get("space") == "nvme" else ""))
m = p["memory"]
print("memory.nvme.params", m["nvme"]["params"], "state", m["nvme"]["state"], "file",
      m["nvme"]["file"], "memory.host.params", m["host"]["params"])
named = [k for k, inst in enumerate(p["program"])
         if any(bufs[i].get("space") == "nvme" for i in inst["in"] + inst["out"])]
print("no instruction names a swap-file buffer" if not named
      else f"instructions {named} name swap-file buffers")
for k, inst in enumerate(p["program"]):
    swaps = inst.get("attrs", {}).get("swap")
    if not swaps:
        continue
    if inst["op"] == "to_device":
        (f, s, w, *off), = swaps
        off = off[0] if off else 0
        fb, sb, src = bufs[f], bufs[s], bufs[inst["in"][0]]
        # The copy reads a view of its staging whose bytes sit where the
        # bytes it stands for sit in the file buffer's blocks.
        # (whole: the file buffer's bytes; part: whole blocks from `off`)
        whole = len(swaps[0]) == 3 and sb["bytes"] == fb["bytes"]
        ok = (not w and sb.get("space") == "host" and not sb["persistent"] and
              off % A == 0 and (whole or sb["bytes"] % A == 0) and off + sb["bytes"] <=
              (fb["bytes"] + A - 1) // A * A and sb["offset"] % A == 0 and root(src) == s and
              src["dtype"] == fb["dtype"] and sb["first"] <= k <= sb["last"])
        print(f"#{k} to_device of {fb['name']}: blocks [{off}, {off + sb['bytes']}) into a "
              f"staging of {sb['bytes']} B, copies {src['bytes']} B from its byte "
              f"{src['offset'] - sb['offset']}" + ("" if ok else f" BAD {swaps}")
              + (f", read after #{inst['attrs']['swap_read_at']}"
                 if "swap_read_at" in inst["attrs"] else ", read at it"))
    else:
        unit = [sw for sw in swaps if bufs[sw[0]]["kind"] == "param"]
        joins = [j for j, x in enumerate(p["program"]) if x["op"] == "wait" and
                 unit and x["in"][0] == unit[0][1]]
        print(f"#{k} {inst['op']}: swaps {len(swaps)}, the unit "
              + (f"{bufs[unit[0][0]]['name']} read and written, its staging first in out"
                 if unit and unit[0][2] and len(unit[0]) == 3 and inst["out"][0] == unit[0][1]
                 else "NOT SWAPPED" if not unit else f"BAD {unit}")
              + (f", joined at #{joins[0]}" if joins else ""))
