#!/usr/bin/env python3
"""Checks the compiler's per-rank memory report against the ZeRO formula.

For fp32 parameters, fp32 gradients and AdamW (two fp32 moments, K = 8
bytes/parameter: there is no separate master copy in fp32), model-state
memory per rank is, with Psi the (padded) parameter count and N ranks:

  stage 0 (DDP)        params 4 Psi    grads 4 Psi     state 8 Psi
  stage 1 (opt state)  params 4 Psi    grads 4 Psi     state 8 Psi / N
  stage 2 (+ grads)    params 4 Psi    grads 4 Psi / N state 8 Psi / N
  stage 3 (+ params)   params 4 Psi/N  grads 4 Psi / N state 8 Psi / N

In a static plan, gradients are buffers with live ranges, so "grads" is the
largest number of gradient bytes live at once: exactly 4 Psi for stage 0;
for stage 1 the shards of the reduce-scatter coexist briefly with the whole
gradients (up to 4 Psi (1 + 1/N)); for stages 2/3 the shards coexist with
the whole gradients of at most two units: the one being reduce-scattered
(asynchronously, overlapped) and the one being computed (up to
4 Psi / N + 8 * largest unit).
Prints the table and exits non-zero on any mismatch.

usage: memory_formula.py FSDP_OPT MODEL.mlir [N ...]
"""
import json
import os
import subprocess
import sys
import tempfile


def compile_plan(fsdp_opt, model, n, stage, tmp):
    out = os.path.join(tmp, f"n{n}s{stage}.plan")
    subprocess.run(
        [fsdp_opt, model, "-o", os.devnull,
         f"--fsdp-pipeline=optimizer=adamw world-size={n} stage={stage} "
         f"plan={out} report=false"],
        check=True)
    with open(out) as f:
        return json.load(f)


def main():
    fsdp_opt, model = sys.argv[1], sys.argv[2]
    worlds = [int(a) for a in sys.argv[3:]] or [1, 2, 4]
    failures = []
    rows = []
    base_params = None
    with tempfile.TemporaryDirectory() as tmp:
        for stage in range(4):
            for n in worlds:
                plan = compile_plan(fsdp_opt, model, n, stage, tmp)
                mem = plan["memory"]
                units = [u for u in plan["units"] if not u.get("frozen")]
                psi = sum(u["padded_numel"] for u in units)
                biggest = max(u["padded_numel"] for u in units)
                frozen = sum(u["padded_numel"] for u in plan["units"]
                             if u.get("frozen"))
                p_expect = 4 * (psi + frozen) // (n if stage == 3 else 1)
                s_expect = 8 * psi // (1 if stage == 0 else n)
                g_lo, g_hi = {
                    0: (4 * psi, 4 * psi),
                    1: (4 * psi, 4 * psi + 4 * psi // n),
                    2: (4 * psi // n, 4 * psi // n + 8 * biggest),
                    3: (4 * psi // n, 4 * psi // n + 8 * biggest),
                }[stage]
                got = (mem["params"], mem["grads"], mem["state"])
                ok = (got[0] == p_expect and got[2] == s_expect
                      and g_lo <= got[1] <= g_hi)
                rows.append((stage, n, got, (p_expect, (g_lo, g_hi), s_expect),
                             mem["peak"], ok))
                if not ok:
                    failures.append((stage, n))
                if stage == 0 and n == 1:
                    base_params = psi
    print(f"model-state bytes per rank (Psi = {base_params} padded parameters "
          f"at N=1)")
    print(f"{'stage':>5} {'N':>3} {'params':>10} {'grads':>10} {'state':>10}"
          f" {'sum':>10} {'expected params / grads / state':>36} {'peak':>10}")
    for stage, n, got, exp, peak, ok in rows:
        p, g, s = got
        ep, (glo, ghi), es = exp
        grads = f"{glo}" if glo == ghi else f"{glo}..{ghi}"
        print(f"{stage:>5} {n:>3} {p:>10} {g:>10} {s:>10} {p + g + s:>10}"
              f" {f'{ep} / {grads} / {es}':>36} {peak:>10}"
              f"{'' if ok else '  MISMATCH'}")
    if failures:
        print("FAIL: memory report differs from the ZeRO formula for "
              + ", ".join(f"stage {s} N={n}" for s, n in failures))
        return 1
    print("memory report matches the ZeRO formula")
    return 0


if __name__ == "__main__":
    sys.exit(main())
