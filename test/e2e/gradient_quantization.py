#!/usr/bin/env python3
"""ZeRO++'s quantized gradient reduce-scatter (fsdp-shard
gradient-quantization=int8) end to end on CPU ranks.

usage: gradient_quantization.py BIN_DIR

The MLP of the FSDP2 tutorial (hidden 64, 4 blocks), ZeRO-3 on 3 ranks
(shards padded: 3 does not divide the units), f32 and bf16 compute
(bf16 also with reduce-dtype=bf16 and quantized weights), and HSDP on
2 x 2 ranks, against the same plans without quantization:
- every gradient reduce-scatter of the plan is a quantize of G parts, an
  all-to-all of G x quantizedBytes(S) int8 bytes (S + pad + 4 ceil(S /
  block) a part, ShapeRules.h) and a dequantize that sums G parts into S
  values; the bytes each rank sends a step (fsdp-run's
  comm_bytes_per_step: all-to-all (G-1)/G of its buffer) equal the plan's
  arithmetic;
- the arenas' high-water and peak live bytes are the plan's prediction;
- step 1's loss is bitwise the unquantized plan's (the forward pass reads
  the same parameters; only the gradients are quantized), step 2's is not
  (step 1's update applied the quantized gradients);
- deterministic (two runs' losses and trained parameters bitwise equal),
  and over Gloo (--comm gloo) the trained parameters bitwise shared
  memory's (the all-to-all moves bytes; the sum is each owner's own, in
  part order; only the reported loss's all-reduce adds across ranks in
  the transport's order);
- it trains: the mean of the last 10 of 60 losses is below the first 10's,
  and within 2% of the unquantized run's (a loose sanity bound, not a
  rounding bound: the kernels' error bounds are DeviceConformance.
  QuantizedReductionsMatchTheReference, the whole update against PyTorch
  is torch-oracle.test).

Hierarchical qgZ (ranks-per-node=L, ZeRO++'s): ZeRO-3 on 4 ranks on nodes
of 2 (f32) and on 6 ranks on nodes of 3 (bf16 compute):
- each reduce-scatter is two levels: a quantize of L parts of M S values
  (chunks = G), an all-to-all over group "node" of L x quantizedBytes(M S)
  bytes, a mean into M S f32 values, a quantize of M parts of S, an
  all-to-all over group "cross" of M x quantizedBytes(S) bytes and a mean
  into S values;
- bytes sent a step as the plan's arithmetic; the bytes crossing nodes a
  step (the cross level's) 1/L of what the flat all-to-all sends to other
  nodes, up to the padding of blocks;
- step 1's loss bitwise the unquantized plan's, step 2's not;
- over --nnodes 2 --comm hybrid (shared memory in a node, Gloo across)
  and over Gloo the trained parameters bitwise shared memory's;
- the node all-to-alls (only) are marked for the node comm stream, run
  there over hybrid (the trace's track 6) beside the cross-node ones (some
  pair overlaps in time), and node-comm-stream=false trains to bitwise the
  same parameters;
- learns, last-10 mean within 2% of the unquantized run's;
- a launch on other nodes (--nnodes G: a rank a node) runs with a warning
  naming the plan's node size, one on the plan's nodes without.
"""
import json
import os
import sys
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e_lib import (Checks, gen_models, run_json, arenas_measured_as_planned,  # noqa: E402
                     quantized_bytes, group_size, ring_bytes)

BLOCK = 64
STEPS = 60


def compile_plan(bindir, model, path, world, opts):
    subprocess.run([os.path.join(bindir, "fsdp-opt"), model,
                    f"--fsdp-pipeline=optimizer=adamw world-size={world} stage=3 {opts} "
                    f"plan={path} report=false", "-o", os.devnull], check=True)
    with open(path) as f:
        return json.load(f)


def ops(plan, name):
    return [i for i in plan["program"] if i["op"] == name]


def main():
    bindir = sys.argv[1]
    check = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        model = gen_models(tmp, {"mlp": ["mlp", "--hidden", "64", "--blocks", "4",
                                         "--batch", "48"]})["mlp"]
        cases = (("f32", 3, ""), ("bf16", 3, "param-dtype=bf16"),
                 ("bf16 reduce-dtype=bf16 + qwZ", 3,
                  "param-dtype=bf16 reduce-dtype=bf16 weight-quantization=int8"),
                 ("HSDP 2x2 f32", 4, "mesh=2x2"))
        for k, (name, world, opts) in enumerate(cases):
            # (quantization-block is qwZ's block too: the same in both.)
            ref = compile_plan(bindir, model, os.path.join(tmp, f"{k}.plan"), world,
                               f"{opts} quantization-block={BLOCK}")
            qpath = os.path.join(tmp, f"{k}-q.plan")
            q = compile_plan(bindir, model, qpath, world,
                             f"{opts} gradient-quantization=int8 quantization-block={BLOCK}")
            bufs, rbufs = q["buffers"], ref["buffers"]
            a2a, rs = ops(q, "all_to_all"), ops(ref, "reduce_scatter")
            sums = [i for i in ops(q, "dequantize") if "reduce" in i["attrs"]]
            ok = len(a2a) == len(rs) == len(sums) > 0 and not ops(q, "reduce_scatter")
            for a, r, d in zip(a2a, rs, sums):
                g = group_size(q, a)
                shard = rbufs[r["out"][0]]["shape"][0]
                ok &= (bufs[a["in"][0]]["dtype"] == "i8" and
                       bufs[a["in"][0]]["bytes"] == g * quantized_bytes(shard, BLOCK) and
                       bufs[d["out"][0]]["shape"] == [shard] and
                       d["attrs"]["parts"] == g and d["attrs"]["reduce"] == "mean")
            check(ok, f"{name}: {len(a2a)} reduce-scatters are all-to-alls of G parts of "
                      f"S + pad + 4 ceil(S/{BLOCK}) int8 bytes, summed into S values")

            rl, rsum = run_json(bindir, os.path.join(tmp, f"{k}.plan"), world, "--steps",
                                str(STEPS))
            saved = [os.path.join(tmp, f"{k}-{c}.safetensors") for c in ("shm", "shm2", "gloo")]
            ql, qs = run_json(bindir, qpath, world, "--steps", str(STEPS), "--save", saved[0])
            ql2, _ = run_json(bindir, qpath, world, "--steps", str(STEPS), "--save", saved[1])
            gl, gs = run_json(bindir, qpath, world, "--steps", str(STEPS), "--comm", "gloo",
                              "--save", saved[2])
            params = []
            for path in saved:
                with open(path, "rb") as f:
                    params.append(f.read())
            for what, p, s in (("unquantized", ref, rsum), ("quantized", q, qs),
                               ("quantized over gloo", q, gs)):
                check(s["comm_bytes_per_step"] == ring_bytes(p),
                      f"{name} {what}: {s['comm_bytes_per_step']} bytes sent a step, "
                      f"{ring_bytes(p)} by the plan's arithmetic")
            check(arenas_measured_as_planned(qs, q), f"{name}: arenas measured as planned")
            reduced = (sum(bufs[a["in"][0]]["bytes"] for a in a2a) /
                       sum(rbufs[r["in"][0]]["bytes"] for r in rs))
            print(f"measured: {name}: reduce-scatter bytes {reduced:.3f}x, a step's bytes "
                  f"sent {qs['comm_bytes_per_step']} vs {rsum['comm_bytes_per_step']} "
                  f"({qs['comm_bytes_per_step'] / rsum['comm_bytes_per_step']:.3f}x); "
                  f"peak {qs['measured_high_water']} vs {rsum['measured_high_water']}; "
                  f"last-10 mean {sum(ql[-10:]) / 10:.5f} vs {sum(rl[-10:]) / 10:.5f}")
            check(ql[0] == rl[0] and ql[1] != rl[1],
                  f"{name}: step 1's loss bitwise the unquantized plan's, step 2's not "
                  f"({ql[1]!r} vs {rl[1]!r})")
            check(ql == ql2 and params[0] == params[1], f"{name}: two runs bitwise equal")
            # The trained parameters: the loss's all-reduce over 3 or 4
            # ranks adds in each transport's order, the parameters depend
            # on no sum across ranks but each owner's, in part order.
            check(params[0] == params[2],
                  f"{name}: parameters after {STEPS} steps over gloo bitwise shared memory's")
            qm, rm = sum(ql[-10:]) / 10, sum(rl[-10:]) / 10
            check(qm < sum(ql[:10]) / 10 and abs(qm - rm) < 0.02 * rm,
                  f"{name}: learns, last-10 mean within 2% of the unquantized run's")
        hierarchical(bindir, model, tmp, check)
    return check.finish("gradient quantization checks pass")


def hierarchical(bindir, model, tmp, check):
    for k, (name, world, node, opts) in enumerate(
            (("hierarchical, 4 ranks on nodes of 2, f32", 4, 2, ""),
             ("hierarchical, 6 ranks on nodes of 3, bf16", 6, 3, "param-dtype=bf16"))):
        nodes = world // node
        ref = compile_plan(bindir, model, os.path.join(tmp, f"h{k}.plan"), world,
                           f"{opts} quantization-block={BLOCK}")
        flat = compile_plan(bindir, model, os.path.join(tmp, f"h{k}-flat.plan"), world,
                            f"{opts} gradient-quantization=int8 quantization-block={BLOCK} "
                            "ranks-per-node=0")
        qpath = os.path.join(tmp, f"h{k}-q.plan")
        q = compile_plan(bindir, model, qpath, world,
                         f"{opts} gradient-quantization=int8 quantization-block={BLOCK} "
                         f"ranks-per-node={node}")
        bufs, rbufs = q["buffers"], ref["buffers"]
        rs = ops(ref, "reduce_scatter")
        quant = [i for i in ops(q, "quantize") if "parts" in i["attrs"]]
        a2a = ops(q, "all_to_all")
        sums = [i for i in ops(q, "dequantize") if "reduce" in i["attrs"]]
        ok = (q.get("mesh", {}).get("node") == node and not ops(q, "reduce_scatter") and
              len(a2a) == len(sums) == len(quant) == 2 * len(rs) > 0)
        # Each unit's chain followed through its buffers: fsdp-schedule
        # interleaves neighbouring units' levels (a unit's node exchange
        # travels while the next unit computes), so it is not contiguous.
        hops = [x for x in a2a if x["attrs"].get("group") == "node"]
        ok &= len(hops) == len(rs)

        def reader(insts, buf):
            found = [i for i in insts if i["in"][:1] == [buf]]
            return found[0] if len(found) == 1 else None
        for r, x1 in zip(rs, hops):
            shard = rbufs[r["out"][0]]["shape"][0]
            q1 = next((i for i in quant if i["out"] == x1["in"]), None)
            d1 = reader(sums, x1["out"][0])
            q2 = d1 and reader(quant, d1["out"][0])
            x2 = q2 and reader(a2a, q2["out"][0])
            d2 = x2 and reader(sums, x2["out"][0])
            if not (q1 and d2):
                ok = False
                break
            ok &= (q1["attrs"].get("chunks") == world and q1["attrs"]["parts"] == node and
                   bufs[x1["in"][0]]["bytes"] == node * quantized_bytes(nodes * shard, BLOCK) and
                   d1["attrs"]["parts"] == node and bufs[d1["out"][0]]["shape"] == [nodes * shard]
                   and bufs[d1["out"][0]]["dtype"] == "f32" and
                   "chunks" not in q2["attrs"] and q2["attrs"]["parts"] == nodes and
                   x2["attrs"].get("group") == "cross" and
                   bufs[x2["in"][0]]["bytes"] == nodes * quantized_bytes(shard, BLOCK) and
                   d2["attrs"]["parts"] == nodes and bufs[d2["out"][0]]["shape"] == [shard] and
                   d2["attrs"]["reduce"] == d1["attrs"]["reduce"] == "mean")
        check(ok, f"{name}: {len(rs)} reduce-scatters are a node all-to-all of L parts of "
                  f"M S values and a cross all-to-all of M parts of S")
        # fsdp-schedule defers each node exchange's tail: every unit's but
        # the last one's node all-to-all is waited for only after the next
        # unit's gradient matmuls (it travels behind them).
        prog = q["program"]
        at = {id(i): k for k, i in enumerate(prog)}
        behind = []
        for x in hops:
            pos = at[id(x)]
            w = next(j for j in range(pos + 1, len(prog))
                     if prog[j]["op"] == "wait" and prog[j]["in"] == x["out"])
            behind.append(sum(1 for i in prog[pos + 1:w] if i["op"] == "matmul"))
        check(len(behind) > 1 and all(n > 0 for n in behind[:-1]),
              f"{name}: matmuls run while each node all-to-all is in flight (all but "
              f"the last unit's): {behind}")
        # Bytes a rank sends across nodes a step: the cross level's
        # (M-1)/M, against the flat all-to-all's parts for other nodes.
        inter = sum((nodes - 1) * bufs[x["in"][0]]["bytes"] // nodes
                    for x in a2a if x["attrs"]["group"] == "cross")
        flat_inter = sum((world - node) * flat["buffers"][x["in"][0]]["bytes"] // world
                         for x in ops(flat, "all_to_all"))
        check(abs(inter * node - flat_inter) <= 0.05 * flat_inter,
              f"{name}: {inter} bytes a step cross nodes, {flat_inter} with one all-to-all "
              f"({flat_inter / inter:.2f}x, L = {node})")

        rl, rsum = run_json(bindir, os.path.join(tmp, f"h{k}.plan"), world, "--steps",
                            str(STEPS))
        fl, _ = run_json(bindir, os.path.join(tmp, f"h{k}-flat.plan"), world, "--steps",
                         str(STEPS))
        saved = [os.path.join(tmp, f"h{k}-{c}.safetensors")
                 for c in ("shm", "hybrid", "gloo", "waited", "onestream")]
        trace = os.path.join(tmp, f"h{k}-hybrid.trace")
        ql, qs = run_json(bindir, qpath, world, "--steps", str(STEPS), "--save", saved[0])
        hl, hs = run_json(bindir, qpath, world, "--steps", str(STEPS), "--nnodes", "2",
                          "--comm", "hybrid", "--save", saved[1], "--trace", trace)
        gl, gs = run_json(bindir, qpath, world, "--steps", str(STEPS), "--comm", "gloo",
                          "--save", saved[2])
        # Session 48's schedule (each node exchange waited for at once):
        # the same arithmetic in another order, so bitwise the same.
        wpath = os.path.join(tmp, f"h{k}-waited.plan")
        waited = compile_plan(bindir, model, wpath, world,
                              f"{opts} gradient-quantization=int8 quantization-block={BLOCK} "
                              f"ranks-per-node={node} overlap-node-exchange=false")
        run_json(bindir, wpath, world, "--steps", str(STEPS), "--save", saved[3])
        # node-comm-stream=false: every collective on the one comm stream.
        opath = os.path.join(tmp, f"h{k}-onestream.plan")
        onestream = compile_plan(bindir, model, opath, world,
                                 f"{opts} gradient-quantization=int8 quantization-block={BLOCK} "
                                 f"ranks-per-node={node} node-comm-stream=false")
        run_json(bindir, opath, world, "--steps", str(STEPS), "--save", saved[4])
        marked = [x.get("attrs", {}).get("stream") for x in ops(q, "all_to_all")]
        check(marked == [("node" if x["attrs"].get("group") == "node" else None)
                         for x in ops(q, "all_to_all")] and "node" in marked and
              not any("stream" in x.get("attrs", {}) for x in onestream["program"]),
              f"{name}: the node all-to-alls (only) are marked for the node comm stream; "
              "node-comm-stream=false marks none")
        # [Note: node comm stream]: over hybrid, the node all-to-alls ran on
        # the node comm stream's track (6), the cross-node ones on the comm
        # stream's (1), and on some rank a node exchange ran while a
        # cross-node one was in flight (on one stream they never can).
        with open(trace) as f:
            spans = [e for e in json.load(f)["traceEvents"]
                     if e.get("ph") == "X" and e["name"] == "all_to_all"]
        tracks = {(e["tid"], e["args"]["group"]) for e in spans}
        both = sum(1 for a in spans for c in spans
                   if a["tid"] == 6 and c["tid"] == 1 and a["pid"] == c["pid"] and
                   a["ts"] < c["ts"] + c["dur"] and c["ts"] < a["ts"] + a["dur"])
        check(tracks == {(6, "node"), (1, "cross")} and both > 0,
              f"{name}: over hybrid the node all-to-alls ran on the node comm stream "
              f"beside the cross-node ones ({both} overlapping pairs; tracks {sorted(tracks)})")
        # The memory-budget search weighs overlap-node-exchange (the other
        # knobs pinned as compiled here, per-unit prefetch depth off: a
        # unit's backward gather where it is read would fit too): a budget
        # between the two plans' arenas picks the waited schedule, one at
        # the overlapped plan's arena keeps the overlap.
        if k == 0:
            hi, lo = q["arena_bytes"], waited["arena_bytes"]
            picked = {}
            for budget in ((hi + lo) // 2, hi):
                sp = compile_plan(bindir, model, os.path.join(tmp, f"h{k}-search.plan"), world,
                                  f"{opts} gradient-quantization=int8 "
                                  f"quantization-block={BLOCK} ranks-per-node={node} "
                                  f"memory-budget={budget} layers-per-unit=1 recompute=none "
                                  "reshard-after-forward=true prefetch-depth=1 "
                                  "backward-prefetch=pre offload=none "
                                  "search-unit-prefetch=false")
                picked[budget] = (sp["strategy"]["overlap_node_exchange"], sp["arena_bytes"])
            check(lo < hi and picked[(hi + lo) // 2] == (False, lo) and
                  picked[hi] == (True, hi),
                  f"{name}: the memory-budget search keeps the overlap at a budget of "
                  f"{hi} bytes and waits for each node exchange at {(hi + lo) // 2} "
                  f"(arenas {hi} and {lo})")
        params = []
        for path in saved:
            with open(path, "rb") as f:
                params.append(f.read())
        check(qs["comm_bytes_per_step"] == ring_bytes(q) == gs["comm_bytes_per_step"],
              f"{name}: {qs['comm_bytes_per_step']} bytes sent a step, {ring_bytes(q)} by "
              "the plan's arithmetic")
        check(arenas_measured_as_planned(qs, q), f"{name}: arenas measured as planned")
        check(ql[0] == rl[0] and ql[1] != rl[1],
              f"{name}: step 1's loss bitwise the unquantized plan's, step 2's not")
        check(params[0] == params[1] == params[2],
              f"{name}: parameters after {STEPS} steps over hybrid (2 nodes) and gloo "
              "bitwise shared memory's")
        check(params[3] == params[0] and waited["program"] != q["program"],
              f"{name}: overlap-node-exchange=false reorders the program and trains to "
              "bitwise the same parameters")
        check(params[4] == params[0],
              f"{name}: node-comm-stream=false trains to bitwise the same parameters")
        qm, rm, fm = sum(ql[-10:]) / 10, sum(rl[-10:]) / 10, sum(fl[-10:]) / 10
        print(f"measured: {name}: bytes across nodes a step {inter} vs {flat_inter} flat; "
              f"a step's bytes sent {qs['comm_bytes_per_step']} vs "
              f"{rsum['comm_bytes_per_step']} unquantized; last-10 mean {qm:.5f} vs "
              f"{fm:.5f} flat qgZ vs {rm:.5f} unquantized")
        check(qm < sum(ql[:10]) / 10 and abs(qm - rm) < 0.02 * rm,
              f"{name}: learns, last-10 mean within 2% of the unquantized run's")
        # A launch whose nodes are not the plan's: warned, not refused.
        said = {}
        for nn in (2, world):
            r = subprocess.run([os.path.join(bindir, "fsdp-run"), qpath, "--nproc", str(world),
                                "--nnodes", str(nn), "--steps", "1", "--quiet"],
                               capture_output=True, text=True, timeout=300)
            said[nn] = r.returncode == 0 and ("over nodes of %d ranks" % node) in r.stderr
        check(not said[2] and said[world],
              f"{name}: a launch on nodes of 1 rank is warned that the plan's nodes are "
              f"of {node}, one on nodes of {node} is not")


if __name__ == "__main__":
    sys.exit(main())
