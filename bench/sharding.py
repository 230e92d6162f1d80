#!/usr/bin/env python3
"""Step time and communication of ZeRO stages 0-3 on N CPU ranks.

For the MLP example, compiles every stage for N = 1, 2, 4, runs S steps
with fsdp-run --nproc N, and prints the median step time relative to N = 1
and the bytes each rank sent per step against the volume each stage needs
in theory (ring algorithms, Psi = padded parameters, 4 bytes each):
  stage 0:   all-reduce                      2 (N-1)/N x 4 Psi
  stage 1/2: reduce-scatter + all-gather     2 (N-1)/N x 4 Psi
  stage 3:   all-gather (forward, backward)  + reduce-scatter
             = 3 (N-1)/N x 4 Psi with reshard-after-forward, less the
             unit gathered last in the forward (its backward keeps that
             gather) and units whose parameters backward does not read
The measured figure is the communicator's count of what the plan's
collectives move (it does not sniff the wire).

  bench/sharding.py BIN_DIR [--hidden H] [--steps S] [--threads T]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def last_forward_unit(p):
    """Padded numel of the last unit the forward reads: the last all-gather
    whose result an instruction before the loss reads (a prefetched
    backward gather is issued before the loss but read after it)."""
    by_buffer = {u["buffer"]: u["padded_numel"] for u in p["units"]}
    prog = p["program"]
    loss = next(i for i, inst in enumerate(prog)
                if inst["op"] in ("mse_loss", "bce_with_logits", "cross_entropy",
                                   "cross_entropy_fused"))
    gathered = {inst["out"][0]: by_buffer[inst["in"][0]] for inst in prog[:loss]
                if inst["op"] == "all_gather" and inst["in"][0] in by_buffer}
    root = lambda b: root(p["buffers"][b]["alias_of"]) if "alias_of" in p["buffers"][b] else b
    last = 0
    for inst in prog[:loss]:
        if inst["op"] != "wait":
            for b in inst["in"]:
                last = gathered.get(root(b), last)
    return last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--overlap", default="true", choices=["true", "false"],
                    help="fsdp-schedule: async collectives and prefetch")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2, 4):
            model = os.path.join(tmp, f"b{n}.mlir")
            # The same global batch on every N.
            subprocess.run([sys.executable, os.path.join(HERE, "..", "examples",
                                                         "gen_models.py"), "mlp",
                            "--hidden", str(a.hidden), "--blocks", str(a.blocks),
                            "--batch", str(a.batch // n), "-o", model], check=True)
            for stage in range(4):
                plan = os.path.join(tmp, f"n{n}s{stage}.plan")
                subprocess.run([os.path.join(a.bindir, "fsdp-opt"), model, "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer=adamw world-size={n} "
                                f"stage={stage} overlap={a.overlap} plan={plan} "
                                f"report=false"], check=True)
                with open(plan) as f:
                    p = json.load(f)
                psi = sum(u["padded_numel"] for u in p["units"])
                cmd = [os.path.join(a.bindir, "fsdp-run"), plan, "--steps", str(a.steps),
                       "--json", "--threads", str(a.threads)]
                if n > 1:
                    cmd += ["--nproc", str(n)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                rows = [json.loads(l) for l in out.splitlines() if '"step"' in l]
                ms = sorted(r["ms"] for r in rows[2:])
                comm = rows[-1]["comm_bytes"]
                factor = {0: 2, 1: 2, 2: 2, 3: 3}[stage]
                theory = factor * (n - 1) / n * 4 * psi
                if stage == 3:
                    theory -= (n - 1) / n * 4 * last_forward_unit(p)
                results[(n, stage)] = (ms[len(ms) // 2], comm, theory, p["memory"]["peak"])
    print(f"MLP hidden {a.hidden}, {a.blocks} blocks, global batch {a.batch}, AdamW, "
          f"{a.threads} thread(s) per rank, overlap={a.overlap}, median of "
          f"{a.steps - 2} steps")
    print(f"{'N':>2} {'stage':>5} {'ms/step':>9} {'vs N=1':>7} {'comm B/rank/step':>17}"
          f" {'theory':>11} {'ratio':>6} {'peak mem/rank':>14}")
    for (n, stage), (ms, comm, theory, peak) in sorted(results.items()):
        base = results[(1, stage)][0]
        ratio = f"{comm / theory:.3f}" if theory else "-"
        print(f"{n:>2} {stage:>5} {ms:>9.2f} {ms / base:>7.2f} {comm:>17} {theory:>11.0f}"
              f" {ratio:>6} {peak:>14}")


if __name__ == "__main__":
    main()
