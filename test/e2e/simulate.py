#!/usr/bin/env python3
"""fsdp-run --trace, fsdp-run --calibrate and fsdp-sim, checked for what
they must say regardless of how fast this machine is (timings are checked
against each other by bench/simulator.py, a benchmark, not here):
  - the measured trace has one compute span per instruction per step per
    rank and one communication span per collective per step per rank;
  - a calibrated profile has positive rates and a link fit at N > 1, and
    with --nvme-dir the drive's rates and its duplex shares in (0, 1];
  - over 2 nodes of 2 (--comm hybrid) it fits the node link and the
    inter-node link on their own groups (two_level), fsdp-opt and fsdp-sim
    price plans with it alike, and one without ranks_per_node is refused;
  - fsdp-sim: no overlap (overlap=false) means every collective is exposed;
    with overlap, exposed <= total communication; the step is at least the
    compute; one rank has no communication; peak memory is the plan's;
    the predicted trace has both streams; bad input is an error;
  - ranks sharing a host's cores: the step is N W / C when the host is
    never idle, and fsdp-opt simulate=true agrees;
  - a pack whose inputs are all in place costs launch + padding only;
  - a fused layer norm costs launch + one pass per folded op;
  - --measured attributes a measured trace (compute, issue, blocked =
    skew + transfer) and refuses another plan's trace.
usage: simulate.py BIN_DIR WORK_DIR
"""
import copy
import importlib.machinery
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

from e2e_lib import copies_in_flight

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")
failures = 0


def report(ok, what):
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {what}")


def main():
    bindir, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    b = lambda t: os.path.join(bindir, t)
    model = os.path.join(work, "m.mlir")
    subprocess.run([sys.executable, GEN, "mlp", "--hidden", "16", "--blocks", "2", "--batch", "4",
                    "-o", model], check=True)
    plans = {}
    for tag, n, extra in (("n1", 1, ""), ("n2", 2, ""), ("n2sync", 2, " overlap=false"),
                          ("hs", 4, " mesh=2x2")):
        plans[tag] = os.path.join(work, tag + ".plan")
        subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                        f"--fsdp-pipeline=optimizer=adamw stage=3 world-size={n}{extra} "
                        f"plan={plans[tag]} report=false"], check=True)

    # The measured trace.
    trace = os.path.join(work, "measured.json")
    subprocess.run([b("fsdp-run"), plans["hs"], "--steps", "3", "--threads", "1", "--nproc", "4",
                    "--quiet", "--trace", trace], check=True, capture_output=True)
    plan = json.load(open(plans["hs"]))
    prog = plan["program"]
    ncoll = sum(i["op"] in ("all_gather", "reduce_scatter", "all_reduce") for i in prog)
    ev = [e for e in json.load(open(trace))["traceEvents"] if e["ph"] == "X"]
    for r in range(4):
        comp = [e for e in ev if e["pid"] == r and e["tid"] == 0]
        comm = [e for e in ev if e["pid"] == r and e["tid"] == 1]
        report(len(comp) == 3 * len(prog) and len(comm) == 3 * ncoll
               and all(e["dur"] >= 0 for e in comp + comm),
               f"measured trace, rank {r}: {len(comp)} compute spans (3 x {len(prog)}), "
               f"{len(comm)} collective spans (3 x {ncoll})")
    r = subprocess.run([b("fsdp-run"), plans["n1"], "--steps", "1", "--trace", work],
                       capture_output=True, text=True)
    report(r.returncode == 1 and "--trace" in r.stderr,
           f"--trace onto a directory: exit {r.returncode}")

    # Calibration.
    swapdir = os.path.join(work, "nvme")
    os.makedirs(swapdir, exist_ok=True)
    out = subprocess.run([b("fsdp-run"), "--calibrate", "--threads", "1", "--nproc", "2",
                          "--nvme-dir", swapdir],
                         check=True, capture_output=True, text=True).stdout
    prof = json.loads(out)
    c, link = prof["compute"], prof["link"]
    # --nvme-dir: the swap file's rates there (offload-nvme's cost), both
    # ranks at once, their files gone after.
    # (and how it moved the bytes: direct, or buffered saying why)
    io = prof.get("nvme", {}).get("io")
    report(c.get("nvme_read_bytes_per_s", 0) > 0 and c.get("nvme_write_bytes_per_s", 0) > 0
           and prof.get("nvme", {}).get("ranks") == 2 and os.listdir(swapdir) == []
           and (io == "direct" or (io == "buffered" and prof["nvme"].get("io_note"))),
           f"calibrated profile: swap file rates on --nvme-dir (read "
           f"{c.get('nvme_read_bytes_per_s', 0) / 1e9:.2f}, write "
           f"{c.get('nvme_write_bytes_per_s', 0) / 1e9:.2f} GB/s a rank, {io} I/O), nothing "
           "left there")
    # A read and a write at once: the share of each solo rate kept, at
    # most 1, the rates it came from beside them.
    nv = prof.get("nvme", {})
    dr, dw = nv.get("duplex_read_bytes_per_s", 0), nv.get("duplex_write_bytes_per_s", 0)
    sr, sw = c.get("nvme_duplex_read_share", 0), c.get("nvme_duplex_write_share", 0)
    report(dr > 0 and dw > 0 and 0 < sr <= 1 and 0 < sw <= 1
           and math.isclose(sr, min(1.0, dr / c.get("nvme_read_bytes_per_s", 1)), rel_tol=1e-12)
           and math.isclose(sw, min(1.0, dw / c.get("nvme_write_bytes_per_s", 1)), rel_tol=1e-12),
           f"calibrated profile: a read and a write at once ran at {dr / 1e9:.2f} / "
           f"{dw / 1e9:.2f} GB/s, duplex shares {sr:.2f} / {sw:.2f} of the solo rates")
    report(c["gemm_flops_per_s"] > 0 and c["mem_bytes_per_s"] > 0 and c["op_overhead_s"] >= 0
           and all(v > 0 for v in c["seconds_per_unit"].values()),
           "calibrated profile: positive GEMM rate, bandwidth and per-kernel costs")
    report(link["ranks"] == 2 and link["alpha_s"] >= 0 and link["beta_s_per_byte"] >= 0
           and len(link["samples"]) == 4, "calibrated profile: link fit at 2 ranks")
    report(link.get("backend") == "shm",
           f"calibrated profile: local ranks calibrate shared memory (backend "
           f"{link.get('backend')})")
    prof_path = os.path.join(work, "cpu.json")
    open(prof_path, "w").write(out)

    # Two nodes of 2 (--comm hybrid): each level fitted on its own groups,
    # the whole communicator's ring fit beside them; fsdp-opt and fsdp-sim
    # read it alike (HSDP 2x2: shard groups are nodes, replica groups one
    # rank a node; 1-D: every group two-level).
    out2 = subprocess.run([b("fsdp-run"), "--calibrate", "--threads", "1", "--nproc", "4",
                           "--nnodes", "2", "--comm", "hybrid"],
                          check=True, capture_output=True, text=True).stdout
    l2 = json.loads(out2)["link"]
    report(l2.get("two_level") is True and l2.get("ranks_per_node") == 2 and l2["ranks"] == 4
           and l2.get("backend") == "shm+gloo" and l2.get("node_backend") == "shm"
           and l2.get("inter_backend") == "gloo"
           and min(l2["alpha_s"], l2["beta_s_per_byte"], l2["inter_alpha_s"],
                   l2["inter_beta_s_per_byte"]) >= 0
           and len(l2["samples"]) == len(l2["inter_samples"]) == len(l2["whole"]["samples"]) == 4,
           "calibrated profile over 2 nodes of 2: node link (shm), inter-node link (gloo) and "
           "the whole ring, 4 sizes each")
    prof2 = os.path.join(work, "hybrid.json")
    open(prof2, "w").write(out2)
    for tag, extra in (("h1d", ""), ("h2x2", " mesh=2x2")):
        plan_path = os.path.join(work, tag + ".plan")
        r = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw stage=3 world-size=4{extra} "
                            f"device-profile={prof2} simulate=true plan={plan_path} report=false"],
                           check=True, capture_output=True, text=True)
        cxx = float(re.search(r"communication\s+([0-9.]+) ms", r.stderr).group(1))
        sj = json.loads(subprocess.run([sys.executable, b("fsdp-sim"), plan_path, "--profile",
                                        prof2, "--json"], check=True, capture_output=True,
                                       text=True).stdout)
        report(abs(cxx - sj["comm_ms"]) <= 6e-4 + 1e-6 * cxx,
               f"two-level profile, {tag}: fsdp-opt communication {cxx} ms, fsdp-sim "
               f"{sj['comm_ms']:.4f} ms")
    # A two-level link without its node size is refused by both.
    bad = json.loads(out2)
    del bad["link"]["ranks_per_node"]
    bad_path = os.path.join(work, "bad-two-level.json")
    json.dump(bad, open(bad_path, "w"))
    r1 = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                         f"--fsdp-pipeline=optimizer=adamw world-size=4 device-profile={bad_path} "
                         "simulate=true report=false"], capture_output=True, text=True)
    r2 = subprocess.run([sys.executable, b("fsdp-sim"), plans["hs"], "--profile", bad_path],
                        capture_output=True, text=True)
    report(r1.returncode != 0 and r2.returncode != 0 and "ranks_per_node" in r1.stderr
           and "ranks_per_node" in r2.stderr,
           "a two-level profile without link.ranks_per_node: refused by fsdp-opt and fsdp-sim")

    # The simulator.
    pred = os.path.join(work, "predicted.json")
    sim = subprocess.run([sys.executable, b("fsdp-sim"), plans["n1"], plans["n2"],
                          plans["n2sync"], plans["hs"], "--profile", prof_path, "--json",
                          "--trace", pred], check=True, capture_output=True, text=True).stdout
    s = {tag: json.loads(l) for tag, l in zip(("n1", "n2", "n2sync", "hs"), sim.splitlines())}
    report(s["n1"]["comm_ms"] == 0 and s["n1"]["exposed_comm_ms"] == 0, "one rank: no communication")
    report(s["n2sync"]["comm_ms"] > 0 and
           abs(s["n2sync"]["exposed_comm_ms"] - s["n2sync"]["comm_ms"]) <= 1e-9 * s["n2sync"]["comm_ms"],
           f"overlap=false: all communication exposed ({s['n2sync']['exposed_comm_ms']:.4f} of "
           f"{s['n2sync']['comm_ms']:.4f} ms)")
    for tag in ("n2", "hs"):
        x = s[tag]
        report(x["exposed_comm_ms"] <= x["comm_ms"] * (1 + 1e-9) and
               x["step_ms"] >= x["compute_ms"] * (1 - 1e-9),
               f"{tag}: exposed {x['exposed_comm_ms']:.4f} <= comm {x['comm_ms']:.4f} ms, "
               f"step {x['step_ms']:.4f} >= compute {x['compute_ms']:.4f} ms")
    for tag in s:
        report(s[tag]["peak_bytes"] == json.load(open(plans[tag]))["memory"]["peak"],
               f"{tag}: predicted peak is the plan's")
    pev = [e for e in json.load(open(pred))["traceEvents"] if e["ph"] == "X"]
    report({e["tid"] for e in pev} == {0, 1} and {e["pid"] for e in pev} == {0, 1, 2, 3},
           "predicted trace: compute and communication tracks for each plan")
    # Collective spans name their group and bytes, the same in the measured
    # (rank 0, step 1) and the predicted trace of the 2x2 plan (pid 3).
    def spans(events):
        return sorted((e["name"], e["args"]["group"], e["args"]["bytes"]) for e in events)
    got = spans(e for e in ev if e["pid"] == 0 and e["tid"] == 1 and e["args"]["step"] == 1)
    want = spans(e for e in pev if e["pid"] == 3 and e["tid"] == 1)
    report(got == want and {g for _, g, _ in got} == {"world", "shard", "replica"},
           f"collective spans name their group and bytes, measured == predicted "
           f"({len(got)} spans, groups {sorted({g for _, g, _ in got})})")
    h = subprocess.run([sys.executable, b("fsdp-sim"), "--model",
                        os.path.join(HERE, "..", "..", "examples", "gpt_small.mlir"),
                        "--ranks", "1,8", "--profile", "h100", "--json",
                        "--fsdp-opt", b("fsdp-opt")], check=True, capture_output=True,
                       text=True).stdout.splitlines()
    h1, h8 = json.loads(h[0]), json.loads(h[1])
    report(h1["comm_ms"] == 0 and h8["comm_ms"] > 0 and h8["peak_bytes"] < h1["peak_bytes"],
           "h100 profile, --model --ranks 1,8: communication appears, memory per rank falls")
    # Processor sharing on a CPU host. With N min(p, q) >= C (p compute
    # threads and q = 1 communication thread per rank, C cores) every
    # moment anything runs wants all C cores, so the host is never idle
    # and the step is exactly N W / C, W = one rank's work: its compute
    # at full speed plus its collectives' calibrated times x C / (N q)
    # (measured with the N ranks all communicating). Both figures come from
    # the same profile with cores = 10^6 (nothing shared).
    def with_cores(cores, name):
        path = os.path.join(work, name)
        q = dict(prof, cores=cores, threads_per_rank=1)
        open(path, "w").write(json.dumps(q))
        return path

    wide, narrow = with_cores(10**6, "wide.json"), with_cores(2, "narrow.json")
    for tag, n in (("n2", 2), ("hs", 4)):
        run = lambda pr: json.loads(subprocess.run(
            [sys.executable, b("fsdp-sim"), plans[tag], "--profile", pr, "--json"],
            check=True, capture_output=True, text=True).stdout)
        w, x = run(wide), run(narrow)
        expect = n / 2 * (w["compute_ms"] + w["comm_ms"] * 2 / n)
        report(abs(x["step_ms"] - expect) <= 1e-9 * expect and x["step_ms"] >= w["step_ms"],
               f"{tag}: {n} ranks sharing 2 cores: step {x['step_ms']:.6f} ms = N W / C = "
               f"{expect:.6f} ms (alone: {w['step_ms']:.6f} ms)")
        # The compiler's twin (fsdp-opt simulate=true) says the same.
        r = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw stage=3 world-size={n}"
                            f"{' mesh=2x2' if tag == 'hs' else ''} report=false simulate=true "
                            f"device-profile={narrow}"], capture_output=True, text=True)
        m = re.search(r"step\s+([0-9.]+) ms", r.stderr)
        report(m is not None and abs(float(m.group(1)) - x["step_ms"]) <= 6e-4,
               f"{tag}: fsdp-opt simulate=true agrees on the shared host "
               f"({m.group(1) if m else r.stderr.strip()} ms)")

    # The link's backend: Gloo's reduce-scatter over 3 ranks is an all-reduce
    # (twice (n-1) alpha), shared memory's is not. alpha = 1 ms, beta = 0,
    # no core sharing: the step's communication is exactly (n-1) alpha per
    # all-gather / reduce-scatter (x2 for Gloo's reduce-scatters) and
    # 2 (n-1) alpha per all-reduce; fsdp-opt simulate=true agrees.
    plan3 = os.path.join(work, "n3.plan")
    subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                    f"--fsdp-pipeline=optimizer=adamw stage=3 world-size=3 prefetch=false "
                    f"plan={plan3} report=false"], check=True)
    ops = [i["op"] for i in json.load(open(plan3))["program"]]
    n_ag, n_rs, n_ar = (ops.count(o) for o in ("all_gather", "reduce_scatter", "all_reduce"))
    for backend, rs_factor in (("gloo", 2), ("shm", 1)):
        path = os.path.join(work, f"link-{backend}.json")
        q = dict(prof, cores=10**6, threads_per_rank=1,
                 link=dict(link, ranks=3, alpha_s=1e-3, beta_s_per_byte=0.0, backend=backend))
        open(path, "w").write(json.dumps(q))
        x = json.loads(subprocess.run([sys.executable, b("fsdp-sim"), plan3, "--profile", path,
                                       "--json"], check=True, capture_output=True,
                                      text=True).stdout.splitlines()[0])
        want = 2 * (n_ag + rs_factor * n_rs + 2 * n_ar)  # ms: (n-1) alpha = 2 ms
        r = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw stage=3 world-size=3 "
                            f"prefetch=false report=false simulate=true device-profile={path}"],
                           capture_output=True, text=True)
        m = re.search(r"step\s+([0-9.]+) ms", r.stderr)
        report(n_rs > 0 and abs(x["comm_ms"] - want) <= 1e-9 * want and m is not None
               and abs(float(m.group(1)) - x["step_ms"]) <= 6e-4,
               f"link backend {backend}: 3-rank communication {x['comm_ms']:.6f} ms = "
               f"{want} ms ({n_ag} all-gathers, {n_rs} reduce-scatters x{rs_factor}, "
               f"{n_ar} all-reduces); fsdp-opt simulate=true: "
               f"{m.group(1) if m else r.stderr.strip()} ms")

    # A pack whose inputs the memory plan placed where the packed buffer
    # wants them costs only its launch and the zeroed padding (the runtime
    # skips in-place inputs), not every operand's bytes.
    plan2 = json.load(open(plans["n2"]))
    bufs = plan2["buffers"]
    ptrace = os.path.join(work, "packs.json")
    subprocess.run([sys.executable, b("fsdp-sim"), plans["n2"], "--profile", wide,
                    "--trace", ptrace], check=True, capture_output=True)
    spans = {e["args"]["instruction"]: e["dur"] * 1e-6
             for e in json.load(open(ptrace))["traceEvents"]
             if e["ph"] == "X" and e["tid"] == 0 and e["name"] == "pack"}
    checked, ok = 0, True
    for i, inst in enumerate(plan2["program"]):
        if inst["op"] != "pack":
            continue
        out = bufs[inst["out"][0]]
        ins = [bufs[x] for x in inst["in"]]
        if any(x["offset"] != out["offset"] + 4 * o
               for x, o in zip(ins, inst["attrs"]["offsets"])):
            continue
        pad = out["bytes"] - sum(x["bytes"] for x in ins)
        want = c["op_overhead_s"] + pad / c["mem_bytes_per_s"]
        ok = ok and abs(spans[i] - want) <= 1e-9 + 1e-6 * want
        checked += 1
    report(checked > 0 and ok and "pack" not in c["seconds_per_unit"],
           f"{checked} packs with every input in place cost launch + padding only")

    # A fused layer norm (fsdp-fuse-epilogues) on a CPU profile costs its
    # launch plus one pass per folded op (runtime/cpu runs the add and the
    # norm one after the other), not also its own operands' bytes.
    gmodel = os.path.join(work, "g.mlir")
    gplan = os.path.join(work, "g.plan")
    subprocess.run([sys.executable, GEN, "gpt", "--vocab", "32", "--ctx", "8", "--layers", "2",
                    "--heads", "2", "--width", "16", "--batch", "2", "-o", gmodel], check=True)
    subprocess.run([b("fsdp-opt"), gmodel, "-o", os.devnull,
                    f"--fsdp-pipeline=optimizer=adamw stage=3 plan={gplan} report=false"],
                   check=True)
    gtrace = os.path.join(work, "gpt.json")
    subprocess.run([sys.executable, b("fsdp-sim"), gplan, "--profile", wide, "--trace", gtrace],
                   check=True, capture_output=True)
    gspans = {e["args"]["instruction"]: e["dur"] * 1e-6
              for e in json.load(open(gtrace))["traceEvents"] if e["ph"] == "X" and e["tid"] == 0}
    gp = json.load(open(gplan))
    spu = c["seconds_per_unit"]
    checked, ok = 0, True
    for i, inst in enumerate(gp["program"]):
        passes = {"residual_layer_norm": ("add", "layer_norm"),
                  "layer_norm_grad_acc": ("layer_norm_grad", "add")}.get(inst["op"])
        if not passes:
            continue
        out = gp["buffers"][inst["out"][0]]
        n = 1
        for d in out["shape"]:
            n *= d
        want = c["op_overhead_s"] + sum(max(n * spu.get(e, 0.0),
                                            2 * out["bytes"] / c["mem_bytes_per_s"])
                                        for e in passes)
        ok = ok and abs(gspans[i] - want) <= 1e-9 + 1e-6 * want
        checked += 1
    report(checked >= 4 and ok,
           f"{checked} fused layer norms cost launch + one pass per folded op")

    # Optimizer offload on the h100 profile: a copy between the arenas costs
    # launch + bytes / the host link (64 GB/s), the host's update launch +
    # max(flops, its bytes / the host memory (307 / 4 GB/s)); the
    # collectives are those of the plan without offload, the step longer;
    # fsdp-opt simulate=true agrees.
    oplan = os.path.join(work, "off.plan")
    nplan = os.path.join(work, "nooff.plan")
    r = {}
    for tag, path in (("optimizer", oplan), ("none", nplan)):
        r[tag] = subprocess.run(
            [b("fsdp-opt"), gmodel, "-o", os.devnull,
             f"--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 offload={tag} "
             f"plan={path} report=false simulate=true"],
            check=True, capture_output=True, text=True).stderr
    otrace = os.path.join(work, "off.json")
    sim = {tag: json.loads(subprocess.run(
        [sys.executable, b("fsdp-sim"), path, "--profile", "h100", "--json"] +
        (["--trace", otrace] if tag == "optimizer" else []),
        check=True, capture_output=True, text=True).stdout)
        for tag, path in (("optimizer", oplan), ("none", nplan))}
    op = json.load(open(oplan))
    # The copies to the host on the compute track, those to the device
    # (fsdp-offload's prefetch: async) on the copy track, the (async) host
    # updates on the host's.
    ospans, tracks = {}, {}
    for e in json.load(open(otrace))["traceEvents"]:
        if e["ph"] == "X" and e["tid"] in (0, 2, 3) and e["name"] != "wait":
            ospans[e["args"]["instruction"]] = e["dur"] * 1e-6
            tracks[e["args"]["instruction"]] = e["tid"]
    copies = hosts = 0
    ok = True
    for i, inst in enumerate(op["program"]):
        out = op["buffers"][inst["out"][0]] if inst["out"] else {}
        if inst["op"] == "wait":
            continue
        if inst["op"] in ("to_host", "to_device"):
            want = 5e-6 + out["bytes"] / 64e9
            ok = ok and tracks.get(i) == (3 if inst["op"] == "to_device" else 0) and \
                inst.get("attrs", {}).get("async", False) == (inst["op"] == "to_device")
            copies += 1
        elif out.get("space") == "host":
            nbytes = sum(op["buffers"][x]["bytes"] for x in inst["in"] + inst["out"])
            want = 5e-6 + nbytes / (307e9 / 4)
            hosts += 1
        else:
            continue
        ok = ok and abs(ospans[i] - want) <= 1e-12 + 1e-6 * want
    m = re.search(r"step\s+([0-9.]+) ms", r["optimizer"])
    report(copies > 0 and hosts > 0 and ok and m is not None and
           abs(float(m.group(1)) - sim["optimizer"]["step_ms"]) <= 6e-4 and
           abs(sim["optimizer"]["comm_ms"] - sim["none"]["comm_ms"]) <= 1e-9 * sim["none"]["comm_ms"] and
           sim["optimizer"]["step_ms"] > sim["none"]["step_ms"],
           f"offload on h100: {copies} copies at the host link, {hosts} host updates at host "
           f"memory; step {sim['optimizer']['step_ms']:.4f} ms (fsdp-opt "
           f"{m.group(1) if m else '?'}) > {sim['none']['step_ms']:.4f} ms without")
    # The host updates run on their own stream (offload-overlap, the
    # default): the plan with them after the backward pass predicts the
    # step longer by at most their time and at least what was hidden; both
    # tools agree on it.
    splan = os.path.join(work, "off-serial.plan")
    rs = subprocess.run(
        [b("fsdp-opt"), gmodel, "-o", os.devnull,
         "--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 offload=optimizer "
         f"offload-overlap=false plan={splan} report=false simulate=true"],
        check=True, capture_output=True, text=True).stderr
    ser = json.loads(subprocess.run([sys.executable, b("fsdp-sim"), splan, "--profile", "h100",
                                     "--json"], check=True, capture_output=True,
                                    text=True).stdout)
    o = sim["optimizer"]
    ms = re.search(r"step\s+([0-9.]+) ms", rs)
    hidden = o["host_ms"] - o["host_exposed_ms"]
    report(ms is not None and abs(float(ms.group(1)) - ser["step_ms"]) <= 6e-4 and
           ser["host_ms"] == 0 and o["host_ms"] > 0 and hidden > 0 and
           o["step_ms"] < ser["step_ms"] <= o["step_ms"] + o["host_ms"] + 1e-9,
           f"offload overlap on h100: host updates {o['host_ms']:.4f} ms on the host stream, "
           f"{hidden:.4f} ms of it hidden; step {o['step_ms']:.4f} ms < "
           f"{ser['step_ms']:.4f} ms with offload-overlap=false (fsdp-opt "
           f"{ms.group(1) if ms else '?'})")

    # With clipping the host updates start only after the whole backward
    # pass: with offload-next-step they are joined in the next step, each
    # before its unit's first use, so the steady-state step (the second of
    # two simulated, from one step's end to the next's) hides them behind
    # the next forward pass: shorter than with overlap, by at most the time
    # compute waited for them there; fsdp-opt and fsdp-sim agree on both.
    clip = {}
    for tag, extra in (("overlap", " offload-prefetch=false"),
                       ("next", " offload-next-step=true offload-prefetch=false"),
                       ("overlap-pf", " offload-prefetch=true"),
                       ("next-pf", " offload-next-step=true offload-prefetch=true"),
                       ("next-pf3", " offload-next-step=true offload-prefetch=true "
                                    "offload-prefetch-depth=3")):
        path = os.path.join(work, f"clip-{tag}.plan")
        opt = subprocess.run(
            [b("fsdp-opt"), gmodel, "-o", os.devnull,
             "--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 offload=optimizer "
             f"max-grad-norm=1.0{extra} plan={path} report=false simulate=true"],
            check=True, capture_output=True, text=True).stderr
        sim_ = json.loads(subprocess.run([sys.executable, b("fsdp-sim"), path, "--profile",
                                          "h100", "--json"], check=True, capture_output=True,
                                         text=True).stdout)
        m = re.search(r"step\s+([0-9.]+) ms", opt)
        sim_["opt_step_ms"] = float(m.group(1)) if m else -1.0
        sim_["carried"] = sum(1 for x in json.load(open(path))["program"]
                              if x.get("attrs", {}).get("carried"))
        sim_["in_flight"] = copies_in_flight(json.load(open(path)))
        clip[tag] = sim_
    ov, nx = clip["overlap"], clip["next"]
    report(nx["carried"] > 0 and ov["carried"] == 0 and
           all(abs(x["opt_step_ms"] - x["step_ms"]) <= 6e-4 for x in (ov, nx)) and
           abs(nx["host_ms"] - ov["host_ms"]) <= 1e-9 + 1e-6 * ov["host_ms"] and
           nx["host_exposed_ms"] < ov["host_exposed_ms"] and
           ov["step_ms"] - ov["host_exposed_ms"] - 1e-9 <= nx["step_ms"] < ov["step_ms"],
           f"offload-next-step on h100 with clipping: {nx['carried']} updates joined in the "
           f"next step; step {nx['step_ms']:.4f} ms (fsdp-opt {nx['opt_step_ms']:.3f}) < "
           f"{ov['step_ms']:.4f} ms (fsdp-opt {ov['opt_step_ms']:.3f}); compute waited "
           f"{nx['host_exposed_ms']:.4f} ms for them, {ov['host_exposed_ms']:.4f} ms joined in "
           f"their step")

    # fsdp-offload's prefetch: the copies of the offloaded shards to the
    # device run on the copy stream, each issued one copy ahead. Without
    # it they are compute (no copy-stream time); with it the step is
    # shorter, by at most the copies' time (what it can hide), both with
    # the updates joined in their step and in the next; the two tools
    # agree.
    for tag in ("overlap", "next"):
        off, on = clip[tag], clip[tag + "-pf"]
        report(off["copy_ms"] == 0 and on["copy_ms"] > 0 and
               abs(on["opt_step_ms"] - on["step_ms"]) <= 6e-4 and
               on["step_ms"] < off["step_ms"] <= on["step_ms"] + on["copy_ms"] + 1e-9,
               f"offload-prefetch on h100 ({tag}): copies {on['copy_ms']:.4f} ms on the copy "
               f"stream, {on['copy_exposed_ms']:.4f} ms exposed; step {on['step_ms']:.4f} ms "
               f"(fsdp-opt {on['opt_step_ms']:.3f}) < {off['step_ms']:.4f} ms without")

    # With both, each carried join right before its unit's prefetched copy
    # joins the copy stream instead of compute: on h100 next-step +
    # prefetch is the fastest of the four. Where the host updates outlast
    # a unit's compute (the h100 profile with host memory 100x slower, as
    # a host shared by many GPUs), compute runs on through the units whose
    # updates are done while the copy stream waits: the same plan with its
    # joins put back on compute (the attribute removed; fsdp-run accepts
    # that plan too) is slower in fsdp-sim, and fsdp-opt's model agrees
    # with fsdp-sim on the step.
    # Three copies in flight: the same copies (the copy stream's time is
    # the same bytes at the same rate), queued three deep; the two tools
    # agree on that plan too.
    npf_, np3 = clip["next-pf"], clip["next-pf3"]
    report(np3["in_flight"] == 3 and npf_["in_flight"] == 1 and
           abs(np3["copy_ms"] - npf_["copy_ms"]) <= 1e-9 + 1e-9 * npf_["copy_ms"] and
           abs(np3["opt_step_ms"] - np3["step_ms"]) <= 6e-4,
           f"offload-prefetch-depth=3 on h100 (next-step): {np3['in_flight']} copies in "
           f"flight, copies {np3['copy_ms']:.4f} ms as with 1; step {np3['step_ms']:.4f} ms "
           f"(fsdp-opt {np3['opt_step_ms']:.3f}; with 1: {npf_['step_ms']:.4f} ms)")
    report(all(npf_["step_ms"] < clip[t]["step_ms"] for t in ("overlap", "next", "overlap-pf")),
           f"offload-next-step + prefetch on h100: step {npf_['step_ms']:.4f} ms, the fastest "
           f"(overlap {clip['overlap']['step_ms']:.4f}, next {clip['next']['step_ms']:.4f}, "
           f"overlap + prefetch {clip['overlap-pf']['step_ms']:.4f} ms)")
    spec = importlib.util.spec_from_loader("fsdp_sim", importlib.machinery.SourceFileLoader(
        "fsdp_sim", b("fsdp-sim")))
    fsdp_sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsdp_sim)
    slow = copy.deepcopy(fsdp_sim.BUILTIN["h100"])
    slow["name"] = "h100-slow-host"
    slow["compute"]["host_mem_bytes_per_s"] /= 100
    slow_path = os.path.join(work, "slow-host.json")
    with open(slow_path, "w") as f:
        json.dump(slow, f)
    spath = os.path.join(work, "slow-next-pf.plan")
    sopt = subprocess.run(
        [b("fsdp-opt"), gmodel, "-o", os.devnull,
         "--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 offload=optimizer max-grad-norm=1.0 "
         f"offload-next-step=true offload-prefetch=true plan={spath} report=false simulate=true "
         f"device-profile={slow_path}"], check=True, capture_output=True, text=True).stderr
    splan = json.load(open(spath))
    joins = [x for x in splan["program"] if x.get("attrs", {}).get("copy_stream")]
    carried_n = sum(1 for x in splan["program"] if x.get("attrs", {}).get("carried"))
    for x in joins:
        del x["attrs"]["copy_stream"]
    oncompute = os.path.join(work, "slow-next-pf-compute.plan")
    with open(oncompute, "w") as f:
        json.dump(splan, f)

    def sim_json(path):
        return json.loads(subprocess.run([sys.executable, b("fsdp-sim"), path, "--profile",
                                          slow_path, "--json"], check=True, capture_output=True,
                                         text=True).stdout)
    sc, sk = sim_json(spath), sim_json(oncompute)
    on_copy, on_compute = sc["step_ms"], sk["step_ms"]
    m = re.search(r"step\s+([0-9.]+) ms", sopt)
    report(len(joins) == carried_n > 0 and m is not None and
           abs(float(m.group(1)) - on_copy) <= 6e-4 and on_copy < on_compute,
           f"copy-stream joins, host 100x slower: {len(joins)} of {carried_n} carried joins on the "
           f"copy stream; step {on_copy:.4f} ms (fsdp-opt {m.group(1) if m else '?'}) < "
           f"{on_compute:.4f} ms with them on compute")
    # There, compute's wait for a copy held behind a join until its host
    # update ends is host exposure, the rest of the wait copy exposure: with
    # every join on the copy stream compute never waits at a join, yet
    # host_exposed_ms is not 0. Neither split loses or counts time twice:
    # the step's end waits for nothing in these plans, so the step is
    # compute + exposed communication + the two exposures (one rank, rate
    # 1 on a GPU profile). fsdp-opt reports the same split (3 decimals).
    hx = re.search(r"host updates\s+[0-9.]+ ms\s+waited for them\s+([0-9.]+) ms", sopt)
    cx = re.search(r"activation copies\s+[0-9.]+ ms\s+waited for them\s+([0-9.]+) ms", sopt)

    def whole(x):
        return x["compute_ms"] + x["exposed_comm_ms"] + x["host_exposed_ms"] + x["copy_exposed_ms"]
    report(sc["host_exposed_ms"] > 0 and hx is not None and cx is not None and
           abs(float(hx.group(1)) - sc["host_exposed_ms"]) <= 6e-4 and
           abs(float(cx.group(1)) - sc["copy_exposed_ms"]) <= 6e-4 and
           all(abs(whole(x) - x["step_ms"]) <= 1e-9 * x["step_ms"] for x in (sc, sk)),
           f"copies held behind copy-stream joins, host 100x slower: compute waited "
           f"{sc['host_exposed_ms']:.4f} ms for host updates (fsdp-opt "
           f"{hx.group(1) if hx else '?'}), {sc['copy_exposed_ms']:.4f} ms for copies (fsdp-opt "
           f"{cx.group(1) if cx else '?'}); step {sc['step_ms']:.4f} = compute + exposures "
           f"{whole(sc):.4f} ms (joins on compute: {sk['step_ms']:.4f} = {whole(sk):.4f} ms)")

    # Activation offload on the h100 profile: the async copies run on the
    # copy stream (the fourth track), each launch + bytes / the host link,
    # and at least one beside a collective on the communication track (on
    # one queue they could not overlap); both tools agree on the step and
    # the copies' time. On the CPU profile the device copies in place: no
    # copy-stream time.
    aplan = os.path.join(work, "act.plan")
    ra = subprocess.run(
        [b("fsdp-opt"), gmodel, "-o", os.devnull,
         "--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 offload-activations=true "
         f"plan={aplan} report=false simulate=true"],
        check=True, capture_output=True, text=True).stderr
    atrace = os.path.join(work, "act.json")
    asim = json.loads(subprocess.run(
        [sys.executable, b("fsdp-sim"), aplan, "--profile", "h100", "--json", "--trace", atrace],
        check=True, capture_output=True, text=True).stdout)
    acpu = json.loads(subprocess.run(
        [sys.executable, b("fsdp-sim"), aplan, "--profile", prof_path, "--json"],
        check=True, capture_output=True, text=True).stdout)
    ap = json.load(open(aplan))
    tracks = {}
    for e in json.load(open(atrace))["traceEvents"]:
        if e["ph"] == "X" and e["name"] != "wait":
            tracks.setdefault(e["tid"], []).append(
                (e["args"]["instruction"], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6))
    copy_spans = {i: (t0, t1) for i, t0, t1 in tracks.get(3, [])}
    async_copies = [i for i, inst in enumerate(ap["program"])
                    if inst["op"] in ("to_host", "to_device") and inst.get("attrs", {}).get("async")]
    ok = bool(async_copies) and sorted(copy_spans) == async_copies
    for i in async_copies:
        want = 5e-6 + ap["buffers"][ap["program"][i]["out"][0]]["bytes"] / 64e9
        t0, t1 = copy_spans.get(i, (0.0, 0.0))
        ok = ok and abs((t1 - t0) - want) <= 1e-12 + 1e-6 * want
    beside = sum(1 for c0, c1 in copy_spans.values()
                 for _, m0, m1 in tracks.get(1, []) if min(c1, m1) - max(c0, m0) > 1e-9)
    ma = re.search(r"step\s+([0-9.]+) ms", ra)
    mc = re.search(r"activation copies\s+([0-9.]+) ms", ra)
    report(ok and beside > 0 and ma is not None and mc is not None and
           abs(float(ma.group(1)) - asim["step_ms"]) <= 6e-4 and
           abs(float(mc.group(1)) - asim["copy_ms"]) <= 6e-4 and asim["copy_ms"] > 0 and
           acpu["copy_ms"] == 0,
           f"activation offload on h100: {len(async_copies)} async copies on the copy track, "
           f"{beside} beside a collective; copies {asim['copy_ms']:.4f} ms (fsdp-opt "
           f"{mc.group(1) if mc else '?'}), step {asim['step_ms']:.4f} ms (fsdp-opt "
           f"{ma.group(1) if ma else '?'}); on the CPU profile {acpu['copy_ms']} ms")

    # [Note: node comm stream] on h100 (nodes of 8): hierarchical qgZ on
    # 16 ranks. With node-comm-stream the node all-to-alls run on their own
    # queue (the trace's track 6), some beside a cross-node one on the
    # comm track; on a GPU profile every collective runs at its own speed,
    # so the collectives' total time is the same with one stream and the
    # step is shorter (on one queue a node exchange waits behind the
    # cross-node one before it). Both tools agree on both plans.
    nsim = {}
    for ns in ("true", "false"):
        npath = os.path.join(work, f"nodestream-{ns}.plan")
        ro = subprocess.run(
            [b("fsdp-opt"), gmodel, "-o", os.devnull,
             "--fsdp-pipeline=optimizer=adamw stage=3 world-size=16 gradient-quantization=int8 "
             f"node-comm-stream={ns} plan={npath} report=false simulate=true"],
            check=True, capture_output=True, text=True).stderr
        ntrace = os.path.join(work, f"nodestream-{ns}.json")
        sim = json.loads(subprocess.run(
            [sys.executable, b("fsdp-sim"), npath, "--profile", "h100", "--json", "--trace",
             ntrace], check=True, capture_output=True, text=True).stdout)
        mo = re.search(r"step\s+([0-9.]+) ms", ro)
        spans = [e for e in json.load(open(ntrace))["traceEvents"]
                 if e["ph"] == "X" and e["name"] == "all_to_all"]
        nsim[ns] = (sim, float(mo.group(1)) if mo else -1.0, spans)
    (son, oon, spon), (soff, ooff, spoff) = nsim["true"], nsim["false"]
    overlap = sum(1 for x in spon for c in spon if x["tid"] == 6 and c["tid"] == 1 and
                  x["ts"] < c["ts"] + c["dur"] and c["ts"] < x["ts"] + x["dur"])
    report({(e["tid"], e["args"]["group"]) for e in spon} == {(6, "node"), (1, "cross")} and
           {e["tid"] for e in spoff} == {1} and overlap > 0 and
           abs(son["comm_ms"] - soff["comm_ms"]) <= 1e-9 * soff["comm_ms"] and
           son["step_ms"] < soff["step_ms"] and
           abs(oon - son["step_ms"]) <= 6e-4 and abs(ooff - soff["step_ms"]) <= 6e-4,
           f"node comm stream on h100, 16 ranks in nodes of 8: node all-to-alls on track 6, "
           f"{overlap} beside a cross-node one; comm {son['comm_ms']:.4f} ms either way; step "
           f"{son['step_ms']:.4f} ms (fsdp-opt {oon}) < {soff['step_ms']:.4f} ms on one stream "
           f"(fsdp-opt {ooff})")

    # --measured: where the measured step of the 4-rank trace went.
    r = subprocess.run([sys.executable, b("fsdp-sim"), plans["hs"], "--profile", prof_path,
                        "--measured", trace, "--json"], capture_output=True, text=True)
    ranks = json.loads(r.stdout)["measured"]["ranks"] if r.returncode == 0 else []
    eps = 1e-6
    report(len(ranks) == 4 and all(
        min(x.values()) >= 0 and x["collectives_ms"] > 0 and x["compute_ms"] > 0 and
        abs(x["skew_ms"] + x["transfer_ms"] - x["blocked_ms"]) <= eps and
        x["compute_ms"] + x["issue_ms"] + x["blocked_ms"] <= x["step_ms"] + eps
        for x in ranks),
        "--measured: per rank compute + issue + blocked <= step, blocked = skew + "
        "transfer, collectives > 0")
    r = subprocess.run([sys.executable, b("fsdp-sim"), plans["n2"], "--profile", prof_path,
                        "--measured", trace], capture_output=True, text=True)
    report(r.returncode != 0 and "--measured" in r.stderr and "plan" in r.stderr,
           f"--measured with another plan's trace: exit {r.returncode}: "
           f"{r.stderr.strip()[:100]}")

    # The measured host track (fsdp-offload's async updates): a 2-rank GPT
    # with clipping and offload-next-step, 3 steps traced. Each rank has
    # one host span per async update per step, named as the plan's, each
    # starting after its issue started and ending before its join ended
    # (a carried join, in the next step: the last step's are finished
    # after it); the trace names the "host" thread (the MLP's above has
    # none); --measured sums them (host) and counts compute standing at
    # the joins (host waited) apart from compute.
    hplan = os.path.join(work, "hostnext.plan")
    subprocess.run([b("fsdp-opt"), gmodel, "-o", os.devnull,
                    "--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 offload=optimizer "
                    f"offload-next-step=true max-grad-norm=1.0 plan={hplan} report=false"],
                   check=True)
    htrace = os.path.join(work, "hostnext.json")
    subprocess.run([b("fsdp-run"), hplan, "--steps", "3", "--threads", "1", "--nproc", "2",
                    "--quiet", "--trace", htrace], check=True, capture_output=True)
    hp = json.load(open(hplan))
    hprog = hp["program"]
    updates = [i for i, inst in enumerate(hprog)
               if inst.get("attrs", {}).get("async") and inst["out"] and
               hp["buffers"][inst["out"][0]].get("space") == "host" and
               inst["op"] not in ("to_host", "to_device", "wait")]
    joins = {inst["in"][0]: i for i, inst in enumerate(hprog)
             if inst["op"] == "wait" and inst.get("attrs", {}).get("carried")}
    hdoc = json.load(open(htrace))["traceEvents"]
    hev = [e for e in hdoc if e["ph"] == "X"]
    span = {(e["pid"], e["tid"], e["args"]["step"], e["args"]["instruction"]): e for e in hev}
    problems = []
    for r in range(2):
        host = [e for e in hev if e["pid"] == r and e["tid"] == 2]
        if sorted((e["args"]["step"], e["args"]["instruction"]) for e in host) != \
                [(st, i) for st in (1, 2, 3) for i in updates]:
            problems.append(f"rank {r}: {len(host)} host spans for 3 x {len(updates)} updates")
            continue
        for e in host:
            st, i = e["args"]["step"], e["args"]["instruction"]
            issue = span.get((r, 0, st, i))
            if e["name"] != hprog[i]["op"] or issue is None or e["ts"] < issue["ts"]:
                problems.append(f"rank {r} step {st}: update {i} starts before its issue")
            join = span.get((r, 0, st + 1, joins.get(hprog[i]["out"][0], -1)))
            if st < 3 and (join is None or e["ts"] + e["dur"] > join["ts"] + join["dur"]):
                problems.append(f"rank {r} step {st}: update {i} ends after its join")
    names = sorted(e["args"]["name"] for e in hdoc if e["name"] == "thread_name" and e["pid"] == 0)
    plain = sorted(e["args"]["name"] for e in json.load(open(trace))["traceEvents"]
                   if e["name"] == "thread_name" and e["pid"] == 0)
    r = subprocess.run([sys.executable, b("fsdp-sim"), hplan, "--profile", prof_path,
                        "--measured", htrace, "--json"], capture_output=True, text=True)
    hranks = json.loads(r.stdout)["measured"]["ranks"] if r.returncode == 0 else []
    report(not problems and len(updates) > 0 and len(joins) == len(updates) and
           names == ["communication", "compute", "host"] and
           plain == ["communication", "compute"] and len(hranks) == 2 and
           all(x["host_ms"] > 0 and x["host_waited_ms"] >= 0 and
               x["compute_ms"] + x["issue_ms"] + x["blocked_ms"] + x["host_waited_ms"]
               <= x["step_ms"] + eps for x in hranks),
           f"measured host track: {len(updates)} updates x 3 steps per rank, each after its "
           f"issue and before its join in the next step; --measured host "
           f"{[round(x['host_ms'], 3) for x in hranks]} ms, compute + issue + blocked + host "
           f"waited <= step" + (": " + "; ".join(problems[:3]) if problems else ""))

    # --measured on a GPU trace of a plan with prefetched copies: compute's
    # stall at a copy's wait is copy_waited_ms, at a host update's join
    # host_waited_ms, neither compute. A trace written here by hand (each
    # instruction 10 us on the compute track, each copy's wait 5 ms, each
    # join of a host update 2 ms, the collectives 10 us on their own
    # track), so the sums are known exactly.
    check_measured_copy_waits(b, work, os.path.join(work, "clip-next-pf.plan"))
    check_cache_model(b, work, prof)

    bad = os.path.join(work, "bad.json")
    open(bad, "w").write("{}")
    r = subprocess.run([sys.executable, b("fsdp-sim"), plans["n1"], "--profile", bad],
                       capture_output=True, text=True)
    report(r.returncode != 0 and "fsdp-run --calibrate" in r.stderr,
           f"a profile without figures: exit {r.returncode}")
    r = subprocess.run([sys.executable, b("fsdp-sim"), model, "--profile", "h100"],
                       capture_output=True, text=True)
    report(r.returncode != 0 and "error" in r.stderr, f"not a plan: exit {r.returncode}")
    print("all simulator checks passed" if not failures else f"FAIL: {failures} check(s)")
    return 1 if failures else 0


def lru_cold_bytes(plan, curve, scale):
    """{instruction: cold bytes of a GEMM}, from the definition in
    [Note: the cache model] (passes/CostModel.cpp), the slow way: each
    block touch's reuse distance counts the distinct blocks touched since
    the block's previous touch by scanning back, in a step that repeats."""
    bufs = plan["buffers"]
    arena = max(plan["arena_bytes"], plan.get("host_arena_bytes", 0))
    block = 4096
    while arena // block > 65536:
        block *= 2
    touches = []
    for i, inst in enumerate(plan["program"]):
        if inst["op"] == "wait":
            continue
        for x in dict.fromkeys(inst["in"] + inst["out"]):
            b = bufs[x]
            lo, hi = b["offset"], b["offset"] + b["bytes"]
            for k in range(lo // block, -(-hi // block)):
                touches.append((i, (k, b.get("space", "device")),
                                min(hi, (k + 1) * block) - max(lo, k * block)))
    n = len(touches)
    xs, ys = curve["bytes"], curve["cold_fraction"]
    cold = {}
    for pos in range(n, 2 * n):
        i, key, nbytes = touches[pos % n]
        seen = set()
        for back in range(pos - 1, pos - n - 1, -1):
            k = touches[back % n][1]
            if k == key:
                break
            seen.add(k)
        d = len(seen) * block * scale
        if d <= xs[0]:
            f = ys[0]
        elif d >= xs[-1]:
            f = ys[-1]
        else:
            j = next(j for j in range(1, len(xs)) if d <= xs[j])
            w = (math.log(d) - math.log(xs[j - 1])) / (math.log(xs[j]) - math.log(xs[j - 1]))
            f = ys[j - 1] + (ys[j] - ys[j - 1]) * w
        if plan["program"][i]["op"] in ("matmul", "matmul_bias", "matmul_gelu_grad",
                                        "matmul_bias_grad"):
            cold[i] = cold.get(i, 0.0) + nbytes * f
    return cold


def check_measured_copy_waits(b, work, plan_path):
    plan = json.load(open(plan_path))
    prog = plan["program"]
    colls = ("all_gather", "reduce_scatter", "all_reduce")
    is_copy = lambda x: x["op"] in ("to_host", "to_device") and x.get("attrs", {}).get("async")
    copy_out = {x["out"][0] for x in prog if is_copy(x)}
    host_out = {x["out"][0] for x in prog
                if x.get("attrs", {}).get("async") and x["op"] not in colls + ("wait",)
                and not is_copy(x) and plan["buffers"][x["out"][0]].get("space") == "host"}
    events, want = [], {"copy": 0.0, "host": 0.0, "compute": 0.0}
    for rank in range(plan["world_size"]):
        for step in range(4):
            t = step * 1e6  # us
            for i, x in enumerate(prog):
                dur, name = 10.0, x["op"]
                if x["op"] == "wait" and x["in"][0] in copy_out:
                    dur, kind = 5000.0, "copy"
                elif x["op"] == "wait" and x["in"][0] in host_out:
                    dur, kind = 2000.0, "host"
                elif x["op"] == "wait" or x.get("attrs", {}).get("async"):
                    kind, name = None, (name if x["op"] == "wait" else "issue " + name)
                else:
                    kind = "compute"
                args = {"step": step, "instruction": i}
                events.append({"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": t,
                               "dur": dur, "args": args})
                if x["op"] in colls:
                    events.append({"name": x["op"], "ph": "X", "pid": rank, "tid": 1, "ts": t,
                                   "dur": dur, "args": args})
                if step == 3 and rank == 0 and kind:
                    want[kind] += dur * 1e-3
                t += dur
    trace = os.path.join(work, "copy-waits.json")
    with open(trace, "w") as f:
        json.dump({"traceEvents": events}, f)
    r = subprocess.run([sys.executable, b("fsdp-sim"), plan_path, "--profile", "h100",
                        "--measured", trace, "--json"], capture_output=True, text=True)
    got = json.loads(r.stdout)["measured"]["ranks"][0] if r.returncode == 0 else {}
    ok = (r.returncode == 0 and want["copy"] > 0 and want["host"] > 0 and
          all(abs(got.get(k, -1) - want[w]) <= 1e-6 for k, w in
              (("copy_waited_ms", "copy"), ("host_waited_ms", "host"), ("compute_ms", "compute"))))
    report(ok, f"--measured on a hand-written trace of the next-step + prefetch plan: copy waits "
               f"{got.get('copy_waited_ms', -1):.3f} ms (want {want['copy']:.3f}), host joins "
               f"{got.get('host_waited_ms', -1):.3f} (want {want['host']:.3f}), compute "
               f"{got.get('compute_ms', -1):.3f} (want {want['compute']:.3f})"
               + ("" if r.returncode == 0 else ": " + r.stderr[-300:]))


def check_cache_model(b, work, prof):
    """The cache model ([Note: the cache model] in passes/CostModel.cpp)."""
    c = prof["compute"]
    curve = c.get("cache_curve")
    # A calibrated curve, where this machine shows one (a last-level cache
    # larger than the 96 MiB calibrated would show none).
    if curve is not None:
        xs, ys = curve["bytes"], curve["cold_fraction"]
        report(len(xs) == len(ys) > 1 and all(x < y for x, y in zip(xs, xs[1:])) and
               all(0 <= f <= 1 for f in ys) and all(x <= y for x, y in zip(ys, ys[1:])) and
               ys[-1] == 1.0 and c["gemm_cold_bytes_per_s"] > 0,
               f"calibrated cache curve: {len(xs)} increasing distances, fractions "
               f"non-decreasing to 1, cold rate {c['gemm_cold_bytes_per_s']:.3g} B/s")
    else:
        print("ok   calibrated profile: no cache effect measured on this machine "
              "(no cache_curve)")
    # A synthetic curve on a 2-rank plan: GEMMs at 1 MFLOP/s and cold bytes
    # at 1 MB/s (the GEMM term dominates every GEMM), no core sharing
    # (cores = 10^6) but the 2 ranks share the cache (distances x 2).
    model = os.path.join(work, "cache.mlir")
    plan_path = os.path.join(work, "cache.plan")
    subprocess.run([sys.executable, GEN, "mlp", "--hidden", "32", "--blocks", "3", "--batch", "8",
                    "-o", model], check=True)
    subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                    f"--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 plan={plan_path} "
                    "report=false"], check=True)
    plan = json.load(open(plan_path))
    synth = {"bytes": [4096.0, 65536.0], "cold_fraction": [0.0, 1.0]}
    base = dict(c, gemm_flops_per_s=1e6, gemm_flops_per_s_bf16=1e6)
    base.pop("cache_curve", None)
    base.pop("gemm_cold_bytes_per_s", None)
    runs = {}
    for tag, comp in (("without", base),
                      ("with", dict(base, cache_curve=synth, gemm_cold_bytes_per_s=1e6))):
        path = os.path.join(work, f"cache-{tag}.json")
        open(path, "w").write(json.dumps(dict(prof, cores=10**6, threads_per_rank=1,
                                              compute=comp)))
        tr = os.path.join(work, f"cache-{tag}.trace.json")
        out = json.loads(subprocess.run(
            [sys.executable, b("fsdp-sim"), plan_path, "--profile", path, "--json", "--trace", tr],
            check=True, capture_output=True, text=True).stdout)
        spans = {e["args"]["instruction"]: e for e in json.load(open(tr))["traceEvents"]
                 if e["ph"] == "X" and e["tid"] == 0 and e["name"] not in
                 ("wait", "all_gather", "reduce_scatter", "all_reduce")}
        r = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw stage=3 world-size=2 report=false "
                            f"simulate=true device-profile={path}"], capture_output=True, text=True)
        m = re.search(r"step\s+([0-9.]+) ms", r.stderr)
        runs[tag] = (out, spans, float(m.group(1)) if m else None, r.stderr.strip())
    want = lru_cold_bytes(plan, synth, 2)
    (w_out, w_spans, w_opt, w_err), (o_out, o_spans, o_opt, _) = runs["with"], runs["without"]
    got = {i: e["args"].get("cold_bytes", 0.0) for i, e in w_spans.items()}
    gemms = [i for i in want if want[i] > 0]
    report(gemms and len(set(round(v) for v in want.values())) > 2 and
           all(abs(got.get(i, 0.0) - want[i]) <= 1e-9 * want[i] + 1e-9 for i in want) and
           abs(w_out["gemm_cold_bytes"] - sum(want.values())) <= 1e-9 * sum(want.values()),
           f"cache model: {len(gemms)} GEMMs' cold bytes (the trace's cold_bytes) are the LRU "
           f"stack distances' ({sum(want.values()):.0f} B in all, "
           f"{len(set(round(v) for v in want.values()))} distinct)")
    ok = all(abs((w_spans[i]["dur"] - o_spans[i]["dur"]) * 1e-6 - want.get(i, 0.0) / 1e6)
             <= 1e-9 * w_spans[i]["dur"] * 1e-6 + 1e-12 for i in o_spans)
    report(ok and o_out["gemm_cold_bytes"] == 0,
           f"cache model: a GEMM's span grows by exactly cold bytes / cold rate, every other "
           f"span is unchanged ({len(o_spans)} spans)")
    report(w_opt is not None and abs(w_opt - w_out["step_ms"]) <= 6e-4 and
           o_opt is not None and abs(o_opt - o_out["step_ms"]) <= 6e-4 and
           w_out["step_ms"] > o_out["step_ms"],
           f"cache model: fsdp-opt simulate=true agrees ({w_opt} vs fsdp-sim "
           f"{w_out['step_ms']:.4f} ms; {o_opt} vs {o_out['step_ms']:.4f} ms without) "
           f"{'' if w_opt is not None else w_err}")
    # A malformed curve is an error in both.
    bad = os.path.join(work, "cache-bad.json")
    open(bad, "w").write(json.dumps(dict(prof, compute=dict(
        base, cache_curve={"bytes": [65536.0, 4096.0], "cold_fraction": [0.0, 1.0]},
        gemm_cold_bytes_per_s=1e6))))
    r1 = subprocess.run([sys.executable, b("fsdp-sim"), plan_path, "--profile", bad],
                        capture_output=True, text=True)
    r2 = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                         f"--fsdp-pipeline=world-size=2 simulate=true device-profile={bad}"],
                        capture_output=True, text=True)
    report(r1.returncode == 1 and "cache_curve" in r1.stderr and
           r2.returncode != 0 and "cache_curve" in r2.stderr,
           f"a cache curve whose distances decrease: fsdp-sim exit {r1.returncode}, fsdp-opt "
           f"exit {r2.returncode}: {r2.stderr.strip()[:120]}")
    # So is a drive's duplex share outside (0, 1], or not a number.
    for key, v, says in (("nvme_duplex_read_share", 0.0, "(0, 1]"),
                         ("nvme_duplex_write_share", 1.25, "(0, 1]"),
                         ("nvme_duplex_read_share", "0.7", "is not a number")):
        bad = os.path.join(work, "share-bad.json")
        open(bad, "w").write(json.dumps(dict(prof, compute=dict(base, **{key: v}))))
        r1 = subprocess.run([sys.executable, b("fsdp-sim"), plan_path, "--profile", bad],
                            capture_output=True, text=True)
        r2 = subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                             f"--fsdp-pipeline=world-size=2 simulate=true device-profile={bad}"],
                            capture_output=True, text=True)
        report(r1.returncode == 1 and key in r1.stderr and says in r1.stderr and
               r2.returncode != 0 and key in r2.stderr and says in r2.stderr,
               f"{key}={v!r}: fsdp-sim exit {r1.returncode}, fsdp-opt exit {r2.returncode}: "
               f"{r1.stderr.strip()[-100:]}")


if __name__ == "__main__":
    sys.exit(main())
