#!/usr/bin/env python3
"""The two-level cost model against the clock: 4 ranks as 2 nodes of 2
(`fsdp-run --nproc 4 --nnodes 2 --comm hybrid`: shared memory within a
node, Gloo between), priced by one calibration two ways:

  two-level  the profile as `fsdp-run --calibrate` writes it over the hybrid
             communicator: the node link and the inter-node link fitted on
             their own groups (link.two_level), each collective priced as
             the communicator runs it ([Note: hybrid collectives]);
  one ring   the same profile with the whole communicator's ring fit
             (link.whole: what --calibrate wrote before) for every group.

First the collectives themselves: the whole communicator's all-reduce and
all-gather as calibrated (link.whole.samples) against each model's
price. Then training steps (stage 3, AdamW, 1 thread a rank): the MLP and
the small GPT of bench/simulator.py, 1-D and HSDP 2x2 (shard groups =
nodes, replica groups one rank a node); measured step (median of steps
3..S) and the collectives' busy time from a traced run (fsdp-sim
--measured, rank means) against each model's predicted step and
communication. Figures are medians over the rounds (calibration
included). A benchmark, not a test: timings on a shared machine vary.

  bench/hybrid_model.py BIN_DIR [--steps S] [--repeat R]
"""
import argparse
import copy
import importlib.machinery
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "examples", "gen_models.py")
sys.path.insert(0, HERE)
from simulator import MODELS  # noqa: E402

NPROC = ["--nproc", "4", "--nnodes", "2", "--comm", "hybrid", "--threads", "1"]
MESHES = {"1-D": "", "2x2": " mesh=2x2"}


def load_sim(bindir):
    """fsdp-sim as a module: the collective table prices with its own
    comm_cost (the model fsdp-opt shares), not a copy."""
    path = os.path.join(bindir, "fsdp-sim")
    spec = importlib.util.spec_from_loader(
        "fsdp_sim", importlib.machinery.SourceFileLoader("fsdp_sim", path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def price(sim, prof, op, w):
    """One collective of `w` bytes over the whole 4-rank world under `prof`."""
    plan = {"world_size": 4, "buffers": [{"bytes": w}]}
    return sim.comm_cost(plan, {"op": op, "in": [0], "out": [0]}, prof)


def one_ring(prof):
    """The profile with the whole communicator's ring fit for every group."""
    p = copy.deepcopy(prof)
    link = p["link"]
    whole = link.pop("whole")
    for k in ("two_level", "ranks_per_node", "inter_alpha_s", "inter_beta_s_per_byte",
              "inter_samples", "inter_backend", "node_backend"):
        link.pop(k, None)
    link["alpha_s"], link["beta_s_per_byte"] = whole["alpha_s"], whole["beta_s_per_byte"]
    link["samples"] = whole["samples"]
    return p


def one_round(a, b, tmp, sim):
    out = subprocess.run([b("fsdp-run"), "--calibrate"] + NPROC, check=True,
                         capture_output=True, text=True).stdout
    prof = json.loads(out)
    link = prof["link"]
    paths = {"two": os.path.join(tmp, "two.json"), "ring": os.path.join(tmp, "ring.json")}
    json.dump(prof, open(paths["two"], "w"))
    json.dump(one_ring(prof), open(paths["ring"], "w"))
    whole = link["whole"]
    coll = []
    for smp in whole["samples"]:
        w = smp["bytes"]
        for op, key in (("all_reduce", "all_reduce_s"), ("all_gather", "all_gather_s")):
            coll.append((op, w, smp[key], price(sim, prof, op, w),
                         price(sim, one_ring(prof), op, w)))
    steps = []
    for name, args in MODELS.items():
        model = os.path.join(tmp, f"{name}.mlir")
        subprocess.run([sys.executable, GEN] + args + ["-o", model], check=True)
        for mesh, extra in MESHES.items():
            plan = os.path.join(tmp, f"{name}-{mesh}.plan")
            subprocess.run([b("fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=optimizer=adamw stage=3 world-size=4{extra} "
                            f"plan={plan} report=false"], check=True)
            run = subprocess.run([b("fsdp-run"), plan, "--steps", str(a.steps), "--json"] + NPROC,
                                 check=True, capture_output=True, text=True).stdout
            measured = statistics.median(
                [json.loads(l)["ms"] for l in run.splitlines() if '"step"' in l][2:])
            trace = os.path.join(tmp, f"{name}-{mesh}.trace.json")
            subprocess.run([b("fsdp-run"), plan, "--steps", str(a.steps), "--quiet",
                            "--trace", trace] + NPROC, check=True, capture_output=True)
            pred = {}
            for kind, path in paths.items():
                sj = json.loads(subprocess.run(
                    [sys.executable, b("fsdp-sim"), plan, "--profile", path, "--json",
                     "--measured", trace], check=True, capture_output=True,
                    text=True).stdout.splitlines()[0])
                pred[kind] = (sj["step_ms"], sj["comm_ms"])
                ranks = sj["measured"]["ranks"]
                mcomm = sum(r["collectives_ms"] for r in ranks) / len(ranks)
            steps.append((name, mesh, measured, mcomm, pred["two"][0], pred["two"][1],
                          pred["ring"][0], pred["ring"][1]))
    return coll, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    b = lambda t: os.path.join(a.bindir, t)
    sim = load_sim(a.bindir)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeat):
            rounds.append(one_round(a, b, tmp, sim))
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    print(f"4 ranks as 2 nodes of 2 (--comm hybrid), 1 thread a rank; medians of {a.repeat} "
          "rounds, each calibrated afresh")
    print("\nthe whole communicator's collectives (--calibrate's link.whole samples), ms")
    print(f"{'op':>10} {'bytes':>8} {'measured':>9} {'two-level':>10} {'ratio':>6} "
          f"{'one ring':>9} {'ratio':>6}")
    for rows in zip(*(r[0] for r in rounds)):
        op, w = rows[0][0], rows[0][1]
        m, t, o = (1e3 * med(rows, k) for k in (2, 3, 4))
        print(f"{op:>10} {w:>8} {m:>9.3f} {t:>10.3f} {t / m:>6.2f} {o:>9.3f} {o / m:>6.2f}")
    print("\ntraining steps, stage 3, AdamW (ms; comm = the collectives' busy time)")
    print(f"{'model':>5} {'mesh':>4} {'meas step':>9} {'meas comm':>9} | {'two-level':>9} "
          f"{'comm':>7} {'comm/meas':>9} | {'one ring':>9} {'comm':>7} {'comm/meas':>9}")
    worst = {"two": 0.0, "ring": 0.0}
    for rows in zip(*(r[1] for r in rounds)):
        name, mesh = rows[0][0], rows[0][1]
        ms, mc, ts, tc, rs, rc = (med(rows, k) for k in range(2, 8))
        worst["two"] = max(worst["two"], abs(tc / mc - 1))
        worst["ring"] = max(worst["ring"], abs(rc / mc - 1))
        print(f"{name:>5} {mesh:>4} {ms:>9.3f} {mc:>9.3f} | {ts:>9.3f} {tc:>7.3f} "
              f"{tc / mc:>9.2f} | {rs:>9.3f} {rc:>7.3f} {rc / mc:>9.2f}")
    print(f"largest communication error: two-level {100 * worst['two']:.0f}%, "
          f"one ring {100 * worst['ring']:.0f}%")


if __name__ == "__main__":
    main()
