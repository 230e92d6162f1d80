"""Shared pieces of the end-to-end tests (test/e2e/*.py): the check
reporter, the example models they generate, and a fsdp-run call read
back through --json."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "..", "examples", "gen_models.py")


def main_modes(doc, passed, modes):
    """The main of a script run as `SCRIPT BIN_DIR MODE [ARG...]`: `modes`
    maps each mode to (how many ARGs it takes, check(bindir, tmp, *args)
    returning the number of failed checks), run in a temporary directory.
    Prints `passed` or the failure count; returns the exit status (the
    usage, `doc`, for a bad command line)."""
    argv = sys.argv
    if len(argv) < 3 or argv[2] not in modes or len(argv) != 3 + modes[argv[2]][0]:
        raise SystemExit(doc)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        failures = modes[argv[2]][1](argv[1], tmp, *argv[3:])
    print(passed if not failures else f"FAIL: {failures} check(s) differ")
    return 1 if failures else 0


def step_losses(binary, plan, steps, extra=(), timeout=600):
    """The training losses of `BINARY PLAN --steps N --json --threads 1
    EXTRA` (fsdp-run, fsdp-run-emu: one process, any --device)."""
    out = subprocess.run([binary, plan, "--steps", str(steps), "--json", "--threads", "1"]
                         + list(extra), check=True, capture_output=True, text=True,
                         timeout=timeout).stdout
    return [json.loads(l)["loss"] for l in out.splitlines()
            if l.startswith("{") and '"step"' in l]


def cuda_runs(bindir, runner, plan, steps=6, extra=()):
    """The losses of PLAN on the CPU device (fsdp-run), on --device cuda
    (RUNNER: fsdp-run-emu here, fsdp-run on a GPU) and on cuda with
    --cuda-graphs: (cpu, cuda, graphs)."""
    extra = list(extra)
    return (step_losses(os.path.join(bindir, "fsdp-run"), plan, steps, extra),
            step_losses(runner, plan, steps, extra + ["--device", "cuda"]),
            step_losses(runner, plan, steps, extra + ["--device", "cuda", "--cuda-graphs"]))


def safetensors(path):
    """{name: (dtype, shape, bytes)} of a safetensors file (metadata aside)."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"],
                data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


class Checks:
    """Prints each check as `what  ok|MISMATCH` and remembers the failed."""

    def __init__(self):
        self.failures = []

    def __call__(self, ok, what):
        print(f"{what}  {'ok' if ok else 'MISMATCH'}")
        if not ok:
            self.failures.append(what)

    def finish(self, passed):
        """The exit status: 1 after printing the failures, else 0 after
        `passed`."""
        if self.failures:
            print("FAILED:", "; ".join(self.failures))
            return 1
        print(passed)
        return 0


def gen_models(tmp, specs):
    """Writes each model {name: gen_models.py arguments} to tmp/name.mlir;
    returns {name: path}."""
    paths = {}
    for name, args in specs.items():
        paths[name] = os.path.join(tmp, name + ".mlir")
        subprocess.run([sys.executable, GEN] + list(args) + ["-o", paths[name]], check=True)
    return paths


def pipeline_compiler(bindir, tmp, model):
    """compile_(tag, n, pipeline, model=model, check=True): fsdp-opt MODEL
    --fsdp-pipeline="world-size=n PIPELINE" writing tmp/TAG.plan; returns
    (the plan's path, or None when fsdp-opt failed and not check; its
    stderr). With check a failure exits naming the tag."""
    def compile_(tag, n, pipeline, model=model, check=True):
        plan = os.path.join(tmp, tag + ".plan")
        r = subprocess.run([os.path.join(bindir, "fsdp-opt"), model, "-o", os.devnull,
                            f"--fsdp-pipeline=world-size={n} {pipeline} plan={plan} "
                            "report=false"], capture_output=True, text=True)
        if check and r.returncode != 0:
            raise SystemExit(f"fsdp-opt failed ({tag}): {r.stderr}")
        return (plan if r.returncode == 0 else None), r.stderr
    return compile_


def load_json(path):
    """The JSON document at `path` (a plan)."""
    with open(path) as f:
        return json.load(f)


def run_json(bindir, plan, n, *args, timeout=300):
    """fsdp-run PLAN --json ARGS on n ranks: (losses of the training
    steps, the summary row); raises with fsdp-run's stderr if it fails."""
    r = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json"] + list(args)
                       + (["--nproc", str(n)] if n > 1 else []),
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"fsdp-run {plan} failed: {r.stderr}")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    losses = [x["loss"] for x in rows if "step" in x and "loss" in x]
    return losses, [x for x in rows if x.get("summary")][0]


def arenas_as_planned(s, plan=None):
    """Whether fsdp-run's summary row `s` measured both arenas' high-water
    and peak live bytes equal to the plan's prediction, and (with `plan`,
    a plan as JSON) the predicted host peak is the plan's host arena."""
    return (s["measured_high_water"] == s["predicted_peak"] and
            s["measured_peak_live"] == s["predicted_peak_live"] and
            s["measured_host_high_water"] == s["predicted_host_peak"] and
            s["measured_host_peak_live"] == s["predicted_host_peak_live"] and
            (plan is None or s["predicted_host_peak"] == plan["host_arena_bytes"]))


def arenas_measured_as_planned(s, plan):
    """arenas_as_planned where the plan has a host arena (offload); else
    whether the device arena's high-water and peak live bytes are the
    plan's."""
    if "measured_host_high_water" in s:
        return arenas_as_planned(s, plan)
    return (s["measured_high_water"] == s["predicted_peak"] and
            s["measured_peak_live"] == s["predicted_peak_live"])


def train_saved(bindir, plan, n, save, steps=4, timeout=300):
    """fsdp-run PLAN for `steps` steps (lr 1e-2, one thread a rank) on n
    ranks, --save SAVE: (losses, the saved parameters' bytes, the summary
    row); exits with fsdp-run's stderr if it fails."""
    r = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json", "--steps", str(steps),
                        "--lr", "1e-2", "--threads", "1", "--save", save]
                       + (["--nproc", str(n)] if n > 1 else []),
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"fsdp-run {plan} failed: {r.stderr}")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    losses = [x["loss"] for x in rows if "step" in x and "loss" in x]
    with open(save, "rb") as f:
        return losses, f.read(), [x for x in rows if x.get("summary")][0]


def copies_in_flight(plan):
    """The most async copies to the device issued and not yet joined while
    any other instruction of `plan` (a plan as JSON) runs: fsdp-offload's
    prefetch-depth (a reader of two copies waits for both right before
    it, the second issued there, so copies and waits themselves are not
    counted)."""
    pending, most = set(), 0
    for inst in plan["program"]:
        if inst["op"] == "to_device" and inst.get("attrs", {}).get("async"):
            pending.add(inst["out"][0])
        elif inst["op"] == "wait":
            pending.discard(inst["in"][0])
        elif inst["op"] != "to_device":
            most = max(most, len(pending))
    return most


def quantized_bytes(n, block):
    """Bytes of one quantized part of n values (ShapeRules.h quantizedBytes:
    n int8 values padded to 4, then an f32 scale a block)."""
    return (n + 3) // 4 * 4 + 4 * ((n + block - 1) // block)


def group_size(plan, inst):
    """The ranks a collective of `plan` (as JSON) runs over."""
    mesh = plan.get("mesh") or {"replicas": 1, "shards": plan["world_size"]}
    g = inst.get("attrs", {}).get("group", "world")
    node = mesh.get("node", 0)
    return {"world": plan["world_size"], "shard": mesh["shards"], "replica": mesh["replicas"],
            "reshard": mesh.get("reshard", 0), "node": node,
            "cross": mesh["shards"] // node if node else 0}[g]


def ring_bytes(plan):
    """Bytes one rank sends a step by the ring volumes (Comm.h bytesSent):
    all-reduce 2 (G-1)/G of the buffer, the others (G-1)/G."""
    total = 0
    for i in plan["program"]:
        if i["op"] not in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
            continue
        n = group_size(plan, i)
        whole = plan["buffers"][i["out"][0] if i["op"] == "all_gather" else i["in"][0]]["bytes"]
        total += (2 if i["op"] == "all_reduce" else 1) * (n - 1) * whole // n
    return total
