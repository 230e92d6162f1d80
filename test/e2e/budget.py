#!/usr/bin/env python3
"""The memory-budget search chooses the fastest schedule that fits.

Compiles a small GPT (4 layers) for N ranks at stage 3 with every schedule
the search considers, chosen by hand (layers-per-unit 1|2, recompute
none|selective|unit, reshard-after-forward false|true, prefetch-depth
0|1|2, and at depth 1 backward-prefetch pre|post), and predicts each with fsdp-sim (h100). Then, for budgets taken
from those plans' own peaks (each distinct peak, largest first), compiles
with memory-budget=B and checks that
  - the chosen plan's peak is <= B;
  - its predicted step equals the smallest predicted step of the hand
    plans whose peak is <= B (the search finds the optimum of its space);
  - the chosen plan is the hand plan of the same strategy, instruction for
    instruction (the plan file equal but for its `strategy` record);
  - fsdp-opt's simulate=true and fsdp-sim agree on every hand plan (the
    C++ cost model and the Python one are the same model).
A budget one byte below the smallest peak fails, naming that peak as the
floor. Budget-chosen plans (loosest and tightest budget) and a
prefetch-depth=2 plan train on N ranks with losses bitwise equal to the
hand-chosen plan of the same strategy (and depth 2 equal to depth 1, and
backward-prefetch=post equal to pre).

usage: budget.py BIN_DIR SRC_DIR N [PIPELINE OPTION ...]
"""
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from shard_equivalence import GEN  # noqa: E402


def main():
    bindir, src, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = " ".join(sys.argv[4:])  # more pipeline options for every plan
    opt = os.path.join(bindir, "fsdp-opt")
    sim = os.path.join(src, "tools", "fsdp-sim", "fsdp-sim")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "gpt4.mlir")
        subprocess.run([sys.executable, GEN, "gpt", "--vocab", "64", "--ctx", "16",
                        "--layers", "4", "--heads", "2", "--width", "16", "--batch", "4",
                        "-o", model], check=True)
        base = f"optimizer=adamw world-size={n} stage=3 {extra}"

        def compile_plan(tag, options, check=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([opt, model, "-o", os.devnull,
                                f"--fsdp-pipeline={base} {options} plan={plan}"],
                               capture_output=True, text=True)
            if check and r.returncode:
                sys.exit(f"FAIL: fsdp-opt {options}: {r.stderr}")
            return plan, r

        def load(plan):
            with open(plan) as f:
                return json.load(f)

        # --- Every strategy by hand. ------------------------------------------
        hand = {}
        # (prefetch depth, backward-prefetch): the search's schedules, or
        # each depth with backward-prefetch as pinned by `extra`.
        depths = ((0, "pre"), (1, "pre"), (1, "post"), (2, "pre"))
        pinned = re.search(r"backward-prefetch=(\w+)", extra)
        if pinned:
            depths = tuple((d, pinned.group(1)) for d in (0, 1, 2))
        for k, rc, rs, (d, bp) in itertools.product((1, 2), ("none", "selective", "unit"),
                                                    ("false", "true"), depths):
            key = (k, rc, rs == "true", d, bp)
            tag = f"k{k}-{rc}-{rs}-{d}-{bp}"
            plan, r = compile_plan(tag, f"layers-per-unit={k} recompute={rc} "
                                        f"reshard-after-forward={rs} prefetch-depth={d} "
                                        + ("" if pinned else f"backward-prefetch={bp} ") +
                                        "simulate=true report=false")
            s = json.loads(subprocess.run([sim, plan, "--json"], check=True,
                                          capture_output=True, text=True).stdout)
            cxx = float(re.search(r"step\s+([0-9.]+) ms", r.stderr).group(1))
            if abs(cxx - s["step_ms"]) > 6e-4:
                failures.append(f"{tag}: simulate=true says {cxx} ms, fsdp-sim "
                                f"{s['step_ms']:.6f} ms")
            hand[key] = (plan, load(plan)["memory"]["peak"], s["step_ms"])
        print(f"{len(hand)} hand-chosen plans; fsdp-opt simulate=true and fsdp-sim "
              f"{'agree' if not failures else 'DISAGREE'} on every one")

        # --- Topology: rings over more ranks than a node use the slower link.
        def comm16(tag, rpn, extra="", world=16):
            """Communication ms of a 16-rank (or `world`-rank) plan, from
            fsdp-sim, after checking that fsdp-opt simulate=true predicts
            the same."""
            plan16 = os.path.join(tmp, f"n16-{tag}.plan")
            r = subprocess.run([opt, model, "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer=adamw world-size={world} "
                                f"simulate=true ranks-per-node={rpn} {extra} report=false "
                                f"plan={plan16}"],
                               check=True, capture_output=True, text=True)
            cxx = float(re.search(r"communication\s+([0-9.]+) ms", r.stderr).group(1))
            sj = json.loads(subprocess.run([sim, plan16, "--json", "--ranks-per-node",
                                            str(rpn)], check=True, capture_output=True,
                                           text=True).stdout)
            if abs(cxx - sj["comm_ms"]) > 6e-4:
                failures.append(f"{tag}: {cxx} ms vs fsdp-sim {sj['comm_ms']}")
            return sj["comm_ms"]

        topo = {rpn: comm16(f"ranks-per-node={rpn}", rpn) for rpn in (0, 8)}
        slower = topo[8] > topo[0]  # same alpha, beta 1/50e9 instead of 1/450e9
        print(f"16 ranks: communication {topo[0]:.4f} ms on one node, {topo[8]:.4f} ms "
              f"across nodes of 8 {'(inter-node link is slower)' if slower else 'WRONG'}")
        if not slower:
            failures.append("topology")
        # reshard-after-forward=8 (hpZ) on nodes of 8: the backward's gathers
        # stay inside a node, so communication falls below resharding to
        # all 16 (true) and the two models still agree.
        hpz = {rs: comm16(f"reshard-after-forward={rs}", 8, f"reshard-after-forward={rs}")
               for rs in ("true", "8")}
        cheaper = hpz["8"] < hpz["true"]
        print(f"16 ranks, nodes of 8: communication {hpz['true']:.4f} ms resharding to 16, "
              f"{hpz['8']:.4f} ms to 8 {'(backward gathers inside a node)' if cheaper else 'WRONG'}")
        if not cheaper:
            failures.append("reshard group")
        # A shard group of 4 consecutive ranks on nodes of 6 (ranks 4-7
        # straddle ranks 5|6) crosses a node: every shard collective pays the
        # inter-node link, as beyond a node; on nodes of 8 none does.
        mesh = {rpn: comm16(f"mesh3x4-rpn{rpn}", rpn, "mesh=3x4", world=12) for rpn in (6, 8)}
        straddle = mesh[6] > mesh[8]
        print(f"12 ranks, mesh 3x4: communication {mesh[8]:.4f} ms on nodes of 8, "
              f"{mesh[6]:.4f} ms on nodes of 6 "
              f"{'(a shard group straddles two nodes)' if straddle else 'WRONG'}")
        if not straddle:
            failures.append("straddling group")

        # --- Two levels (link.two_level: a profile calibrated over --comm
        # hybrid). Each group's members are listed rank by rank here and
        # each collective priced by hand: within a node on the node link,
        # 1/L of the buffer between the M nodes on the inter-node link.
        # fsdp-opt and fsdp-sim must both give that sum, and a group that
        # stays in a node (or holds one rank a node) must cost what the
        # one-ring model says.
        a, bn, ia, ib = 10e-6, 1 / 450e9, 10e-6, 1 / 50e9
        prof = {"name": "two-level", "compute": {"gemm_flops_per_s": 67e12,
                                                 "mem_bytes_per_s": 3.35e12,
                                                 "op_overhead_s": 5e-6},
                "link": {"ranks_per_node": 8, "alpha_s": a, "beta_s_per_byte": bn,
                         "inter_alpha_s": ia, "inter_beta_s_per_byte": ib}}
        flat_path = os.path.join(tmp, "flat.json")
        two_path = os.path.join(tmp, "two-level.json")
        json.dump(prof, open(flat_path, "w"))
        prof["link"]["two_level"] = True
        json.dump(prof, open(two_path, "w"))

        def ring(op, n, w, alpha, beta):
            if n <= 1:
                return 0.0
            k = 2 if op == "all_reduce" else 1
            return k * ((n - 1) * alpha + (n - 1) / n * w * beta)

        def by_hand(plan_json, two):
            world = plan_json["world_size"]
            mesh = plan_json.get("mesh") or {"replicas": 1, "shards": world}
            total = 0.0
            for inst in plan_json["program"]:
                op = inst["op"]
                if op not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                    continue
                g = inst.get("attrs", {}).get("group", "world")
                node = mesh.get("node", 0)
                size = {"world": world, "shard": mesh["shards"], "replica": mesh["replicas"],
                        "reshard": mesh.get("reshard", 0), "node": node,
                        "cross": mesh["shards"] // node if node else 0}[g]
                if size <= 1:
                    continue
                groups = world // size
                # rank 0's group (every group of these meshes is placed alike)
                stride = groups if g == "replica" else node if g == "cross" else 1
                members = [k * stride for k in range(size)]
                per_node = {}
                for r in members:
                    per_node[r // 8] = per_node.get(r // 8, 0) + 1
                M, L = len(per_node), next(iter(per_node.values()))
                bufs = plan_json["buffers"]
                w = bufs[inst["out"][0] if op == "all_gather" else inst["in"][0]]["bytes"]
                if M == 1:
                    total += ring(op, size, w, a, bn)
                elif not two:
                    total += ring(op, size, w, ia, ib)
                elif op == "all_reduce":
                    total += 2 * ring("all_gather", L, w, a, bn) + ring(op, M, w / L, ia, ib)
                elif op == "all_to_all":  # qgZ: every block for another node crosses
                    total += ring(op, L, w, a, bn) + ring(op, M, w, ia, ib)
                else:
                    total += ring(op, L, w, a, bn) + ring(op, M, w / L, ia, ib)
            return 1e3 * total

        def qgz_flat(plan_json):
            """Hierarchical qgZ's two all-to-alls of a plan (16 ranks on
            nodes of 8, two levels), and by hand the one all-to-all over
            the 16 ranks that they replace: its G parts of S are L times
            the cross level's M parts of S."""
            hier = flat = 0.0
            bufs = plan_json["buffers"]
            for inst in plan_json["program"]:
                g = inst.get("attrs", {}).get("group")
                if inst["op"] != "all_to_all" or g not in ("node", "cross"):
                    continue
                w = bufs[inst["in"][0]]["bytes"]
                if g == "node":
                    hier += ring("all_to_all", 8, w, a, bn)
                else:
                    hier += ring("all_to_all", 2, w, ia, ib)
                    flat += ring("all_to_all", 8, 8 * w, a, bn) + ring("all_to_all", 2, 8 * w, ia, ib)
            return 1e3 * hier, 1e3 * flat

        two_level = {}
        for mesh_opt in ("", "mesh=2x8", "mesh=8x2", "mesh=4x4", "reshard-after-forward=8",
                         "gradient-quantization=int8"):
            for two, path in ((False, flat_path), (True, two_path)):
                tag = f"2lvl-{mesh_opt.replace('=', '') or '1d'}-{two}"
                plan16 = os.path.join(tmp, tag + ".plan")
                r = subprocess.run([opt, model, "-o", os.devnull,
                                    f"--fsdp-pipeline=optimizer=adamw world-size=16 simulate=true "
                                    f"device-profile={path} {mesh_opt} report=false plan={plan16}"],
                                   check=True, capture_output=True, text=True)
                cxx = float(re.search(r"communication\s+([0-9.]+) ms", r.stderr).group(1))
                sj = json.loads(subprocess.run([sim, plan16, "--json", "--profile", path],
                                               check=True, capture_output=True,
                                               text=True).stdout)
                hand_ms = by_hand(load(plan16), two)
                if abs(cxx - sj["comm_ms"]) > 6e-4 or abs(hand_ms - sj["comm_ms"]) > 1e-6 * hand_ms:
                    failures.append(f"{tag}: fsdp-opt {cxx} ms, fsdp-sim {sj['comm_ms']} ms, "
                                    f"by hand {hand_ms} ms")
                two_level[(mesh_opt, two)] = sj["comm_ms"]
                if mesh_opt == "gradient-quantization=int8" and two:
                    # The profile's nodes of 8 make it hierarchical; across
                    # two nodes it moves 1/8 of the flat exchange's bytes.
                    hier, flat = qgz_flat(load(plan16))
                    groups = {i.get("attrs", {}).get("group") for i in load(plan16)["program"]
                              if i["op"] == "all_to_all"}
                    print(f"16 ranks, nodes of 8, two levels, qgZ: all-to-alls {hier:.4f} ms "
                          f"hierarchical, {flat:.4f} ms for one flat all-to-all (by hand)")
                    if groups != {"node", "cross"} or not 0 < hier < flat:
                        failures.append(f"hierarchical qgZ: groups {groups}, {hier} ms, "
                                        f"flat {flat} ms")
        for mesh_opt in ("", "mesh=2x8", "mesh=8x2", "mesh=4x4", "reshard-after-forward=8",
                         "gradient-quantization=int8"):
            flat, two = two_level[(mesh_opt, False)], two_level[(mesh_opt, True)]
            print(f"16 ranks, nodes of 8, {mesh_opt or '1-D'}: communication {flat:.4f} ms "
                  f"one ring, {two:.4f} ms two levels (= by hand)")
        # Never dearer (each level's link no slower than the ring's), and
        # cheaper where the gradients' groups hold several ranks a node.
        if not (all(two_level[(m, True)] <= two_level[(m, False)] for m, _ in two_level)
                and two_level[("", True)] < two_level[("", False)]
                and two_level[("mesh=8x2", True)] < two_level[("mesh=8x2", False)]):
            failures.append("two levels: dearer than one ring, or not cheaper for a 1-D "
                            "or 8x2 mesh")

        # --- recompute-units=K recomputes the first K units only. -------------
        sizes, kpeaks = [], []
        for k in (0, 1, 2, 3, -1):
            plan_k, _ = compile_plan(f"units{k}", f"recompute=unit recompute-units={k} "
                                                  "report=false")
            pk = load(plan_k)
            sizes.append(len(pk["program"]))
            kpeaks.append(pk["memory"]["peak"])
        # (The first unit is the embedding's: its output is the next
        # unit's input, saved anyway, so K = 1 recomputes nothing here.)
        grows = all(a <= b for a, b in zip(sizes, sizes[1:])) and sizes[0] < sizes[2] < sizes[-1]
        shrinks = all(a >= b for a, b in zip(kpeaks, kpeaks[1:])) and kpeaks[0] > kpeaks[-1]
        print(f"recompute-units=0,1,2,3,all: instructions {sizes}, peaks {kpeaks} "
              f"{'(more recomputed, less memory)' if grows and shrinks else 'WRONG'}")
        if not (grows and shrinks):
            failures.append("recompute-units")

        # --- Budgets from the plans' own peaks. -------------------------------
        peaks = sorted({p for _, p, _ in hand.values()}, reverse=True)
        chosen_at = {}
        for budget in peaks:
            plan, r = compile_plan(f"budget{budget}", f"memory-budget={budget} report=false",
                                   check=False)
            if r.returncode:
                failures.append(f"budget {budget}: {r.stderr.strip()}")
                continue
            p = load(plan)
            st = p["strategy"]
            key = (st["layers_per_unit"], st["recompute"], st["reshard_after_forward"],
                   st["prefetch_depth"], st["backward_prefetch"])
            units = st["recompute_units"]
            rs_units = st["reshard_units"]
            unit_depths = st["unit_prefetch_depth"]
            fits = [step for _, peak, step in hand.values()
                    if peak <= budget and step is not None]
            best = min(fits)
            step_ms = st["predicted_step_s"] * 1e3
            if units >= 0 or rs_units >= 0 or unit_depths:
                # Per unit (the first K units recomputed, the first K
                # units resharded, or some units prefetched less deep):
                # at least as fast as every uniform schedule that fits.
                key = key + (units, rs_units, unit_depths)
                if key not in hand:
                    plan_k, _ = compile_plan(
                        f"k{key[0]}-{key[1]}{units}-{key[2]}{rs_units}-{key[3]}{key[4]}-"
                        f"{len(hand)}",
                        f"layers-per-unit={key[0]} recompute={key[1]} recompute-units={units} "
                        f"reshard-after-forward={'true' if key[2] else 'false'} "
                        f"reshard-units={rs_units} prefetch-depth={key[3]} "
                        + (f"unit-prefetch-depth={unit_depths} " if unit_depths else "")
                        + ("" if pinned else f"backward-prefetch={key[4]} ") + "report=false")
                    hand[key] = (plan_k, load(plan_k)["memory"]["peak"], None)
                ok = step_ms <= best * (1 + 1e-9)
            else:
                ok = abs(step_ms - best) <= 1e-9 * best
            ok = ok and p["memory"]["peak"] <= budget and st["peak"] == p["memory"]["peak"]
            same = load(hand[key][0])
            p.pop("strategy")
            ok_same = p == same
            chosen_at[budget] = key
            print(f"  budget {budget:>8}: peak {p['memory']['peak']:>8} "
                  f"layers-per-unit={key[0]} recompute={key[1]}"
                  + (f" recompute-units={units}" if units >= 0 else "") + " "
                  f"reshard-after-forward={'true' if key[2] else 'false'} "
                  + (f"reshard-units={rs_units} " if rs_units >= 0 else "") +
                  f"prefetch-depth={key[3]}"
                  + (f" backward-prefetch={key[4]}" if key[4] != "pre" and key[3] else "")
                  + (f" unit-prefetch-depth={unit_depths}" if unit_depths else "") +
                  f" step {step_ms:.6f} ms "
                  f"(best by hand {best:.6f})"
                  + ("" if ok else " NOT THE BEST FIT")
                  + ("" if ok_same else " NOT THE HAND PLAN"))
            if not ok or not ok_same:
                failures.append(f"budget {budget}")

        # --- Below the floor. --------------------------------------------------
        floor = peaks[-1]
        _, r = compile_plan("floor", f"memory-budget={floor - 1}", check=False)
        m = re.search(r"smallest peak reachable is .* \((\d+) bytes\)", r.stderr)
        named = m and int(m.group(1)) == floor
        print(f"budget {floor - 1}: {'fails naming the floor ' + str(floor) if named else 'WRONG'}")
        for what in ("gradients", "activations", "gathered parameters", "optimizer state"):
            if what not in r.stderr:
                named = False
        if r.returncode == 0 or not named:
            failures.append(f"floor: {r.stderr.strip()}")
        else:
            print("  " + r.stderr.strip().splitlines()[0].split("error: ")[-1][:60] + "...")

        # --- Training: budget-chosen equals hand-chosen, bitwise. --------------
        def train(plan, tag):
            save = os.path.join(tmp, tag + ".safetensors")
            out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--steps", "3",
                                  "--lr", "1e-2", "--json", "--threads", "1", "--save", save,
                                  "--nproc", str(n)],
                                 check=True, capture_output=True, text=True, timeout=300).stdout
            losses = [json.loads(l)["loss"] for l in out.splitlines()
                      if l.startswith("{") and '"step"' in l]
            with open(save, "rb") as f:
                params = f.read()
            return [struct.pack("<d", x) for x in losses], params, losses

        pairs = [(os.path.join(tmp, f"budget{peaks[0]}.plan"), hand[chosen_at[peaks[0]]][0],
                  "loosest budget"),
                 (os.path.join(tmp, f"budget{floor}.plan"), hand[chosen_at[floor]][0],
                  "tightest budget"),
                 (hand[(1, "none", True, 2, "pre")][0], hand[(1, "none", True, 1, "pre")][0],
                  "prefetch-depth=2 vs 1"),
                 ] + ([] if pinned else [
                 (hand[(1, "unit", True, 1, "post")][0], hand[(1, "unit", True, 1, "pre")][0],
                  "backward-prefetch=post vs pre")])
        for a, b, what in pairs:
            ta, tb = train(a, "a"), train(b, "b")
            equal = ta[0] == tb[0] and ta[1] == tb[1]
            print(f"train {what}: losses {' '.join(f'{x:.6f}' for x in ta[2])} "
                  f"{'bitwise equal to the hand-chosen plan' if equal else 'DIFFER'}")
            if not equal:
                failures.append(f"train {what}")

    for f in failures:
        print("FAIL:", f)
    print("all budget checks passed" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
