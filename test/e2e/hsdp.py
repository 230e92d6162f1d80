#!/usr/bin/env python3
"""Hybrid sharding (HSDP, mesh=RxS) is a refactoring of one-rank training.

For every mesh R x S given (R replicas of S shards, N = R*S ranks) and every
stage, compiles the model for per-rank batch G / N with `mesh=RxS`, runs it
on N local ranks and checks:
  1. losses: every step within RTOL (relative) of the one-rank run of the
     same model at global batch G, the gradient norms as
     shard_equivalence.norms_match says (and under SGD the consolidated final
     parameters within 1e-4 of each tensor's largest value; under AdamW see
     shard_equivalence.py for why parameters are not compared);
  2. communication: the bytes each rank sent per step equal the formula
     below, computed from the units' padded sizes;
  3. memory: per-rank parameter storage (stage 3) and optimizer state are
     1/S of the whole (Psi_S = parameters padded to a multiple of S), so
     they fall as 1/S whatever R is.

Communication per rank per step (ring volumes, 4 bytes per element, as
the communicator counts them; // is the floor the counter applies per call):
  stage 0   all-reduce of every unit over all N ranks: 2(N-1)/N x 4 Psi
  stage 1/2 per unit: reduce-scatter in the shard group (S-1)/S x 4 P,
            all-reduce of the shard over the replica group
            2(R-1)/R x 4 P/S, all-gather of the new parameters in the shard
            group (S-1)/S x 4 P
  stage 3   as 1/2 (all-gather before forward instead of after the update)
            with reshard-after-forward off, so each unit is gathered once;
            with it on, units backward reads are gathered again (checked as
            a bound: more than the formula, at most one more gather each:
            in the shard group, or with reshard-after-forward=G in the
            reshard group, (G-1)/G x 4 P)
  plus the loss (all-reduce of one float over N ranks) and, when sharded,
  the clipping norm (all-reduce of one float over the shard group) and,
  for LAMB, each unit's norms (all-reduce of two floats per parameter
  over the shard group).
  (Ring volumes whatever the backend runs: Gloo's reduce-scatter over a
  group whose size is not a power of two moves twice (S-1)/S x 4 P,
  runtime/comm/GlooComm.cpp [Note: Gloo's reduce-scatter], but the counter
  reports the plan's volume; runtime/core/Comm.h.)

usage: hsdp.py BIN_DIR mlp|gpt OPTIMIZER STEPS RTOL RxS [RxS ...]
"""
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import shard_equivalence as se  # noqa: E402  (gen, run, differences, GLOBAL_BATCH)


def ring_all_reduce(n, elems):
    return 2 * (n - 1) * elems * 4 // n


def ring_reduce_scatter(n, shard):
    return (n - 1) * shard * 4


def ring_all_gather(n, shard):
    return (n - 1) * shard * 4


def formula(stage, r, s, units, lamb_norms=()):
    """Bytes per rank per step for the plan's units (padded sizes) and
    LAMB's norms (their sizes)."""
    n = r * s
    total = ring_all_reduce(n, 1)  # the loss
    if n == 1:
        return 0
    if stage == 0 or s == 1:
        return total + sum(ring_all_reduce(n, p) for p in units)
    total += ring_all_reduce(s, 1)  # the clipping norm
    total += sum(ring_all_reduce(s, k) for k in lamb_norms)
    for p in units:
        shard = p // s
        total += ring_reduce_scatter(s, shard) + ring_all_gather(s, shard)
        if r > 1:
            total += ring_all_reduce(r, shard)
    return total


def main():
    se.take_nnodes(sys.argv)
    bindir, kind, optimizer = sys.argv[1], sys.argv[2], sys.argv[3]
    steps, rtol = int(sys.argv[4]), float(sys.argv[5])
    meshes = [tuple(int(x) for x in m.split("x")) for m in sys.argv[6:]]
    # Every N must divide the global batch (12 unless a mesh needs more).
    for r, s in meshes:
        se.GLOBAL_BATCH = se.GLOBAL_BATCH * (r * s) // math.gcd(se.GLOBAL_BATCH, r * s)
    compare_params = optimizer.startswith("sgd")
    moments = not optimizer.startswith("sgd")  # AdamW's and LAMB's m, v
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        ref_model = os.path.join(tmp, "g.mlir")
        se.gen(kind, se.GLOBAL_BATCH, ref_model)
        ref_losses, ref_norms, ref_params, _ = se.run(bindir, ref_model, tmp, "ref", 1, "stage=0",
                                           steps, optimizer)
        print(f"{kind} ({optimizer}): one-rank reference, global batch {se.GLOBAL_BATCH}, "
              f"{steps} steps, losses {ref_losses[0]:.6f} .. {ref_losses[-1]:.6f}")
        for r, s in meshes:
            n = r * s
            model = os.path.join(tmp, f"b{n}.mlir")
            se.gen(kind, se.GLOBAL_BATCH // n, model)
            # reshard-after-forward: false, true (to the S ranks of the
            # shard group) or G (hpZ: to G of them, 1 < G < S).
            configs = [(0, "false"), (1, "false"), (2, "false"), (3, "false"),
                       (3, "true")] + [(3, str(g)) for g in range(2, s) if s % g == 0]
            for stage, reshard in configs:
                tag = f"m{r}x{s}s{stage}r{reshard}"
                pipe = f"stage={stage} mesh={r}x{s} reshard-after-forward={reshard}"
                losses, norms, params, comm = se.run(bindir, model, tmp, tag, n, pipe,
                                                     steps, optimizer)
                with open(os.path.join(tmp, tag + ".plan")) as f:
                    plan = json.load(f)
                units = [u["padded_numel"] for u in plan["units"] if not u["frozen"]]
                # LAMB: per unit, two floats per parameter (the norms' size
                # comes from the plan; the oracle and lit check their layout).
                lamb = [plan["buffers"][op["out"][0]]["shape"][0]
                        for op in plan["program"] if op["op"] == "lamb_norms"]
                want_comm = formula(stage, r, s, units, lamb)
                # Resharding after forward gathers a unit again for backward
                # when backward reads its parameters: at most once more each,
                # within the shard group (true) or the reshard group (G).
                g = s if reshard == "true" else int(reshard) if reshard != "false" else 1
                extra = sum(ring_all_gather(g, p // g) for p in units) if g > 1 else 0
                psi = sum(u["padded_numel"] for u in plan["units"])
                sharded = stage > 0 and s > 1
                want_state = 2 * 4 * psi // (s if sharded else 1)  # AdamW m, v
                want_params = 4 * psi // (s if stage == 3 else 1)
                mem = plan["memory"]
                loss_err, param_err = se.differences(losses, ref_losses, params, ref_params)
                ok_loss = len(losses) == len(ref_losses) and loss_err <= rtol
                ok_norm, _, norm_err = se.norms_match(norms, ref_norms, rtol)
                ok_param = not compare_params or param_err <= 1e-4
                ok_comm = (want_comm < comm <= want_comm + extra if extra
                           else comm == want_comm)
                ok_mem = mem["params"] == want_params and (
                    not moments or mem["state"] == want_state)
                ok = ok_loss and ok_norm and ok_param and ok_comm and ok_mem
                failures += not ok
                formula_text = (f"formula {want_comm}" if not extra else
                                f"formula {want_comm} + up to {extra} regathered")
                print(f"  mesh {r}x{s} stage={stage} reshard={reshard} "
                      f"loss rel diff {loss_err:.2e} norm {norm_err:.1e} "
                      f"param diff {param_err:.2e} comm {comm} B ({formula_text}) "
                      f"params {mem['params']} B state {mem['state']} B  "
                      f"{'ok' if ok else 'MISMATCH'}"
                      + ("" if ok_loss else " [losses]") + ("" if ok_norm else " [norms]")
                      + ("" if ok_param else " [params]")
                      + ("" if ok_comm else " [comm]") + ("" if ok_mem else " [memory]"))
    print("all hybrid-sharded runs match the one-rank run" if not failures
          else f"FAIL: {failures} configuration(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
