#!/usr/bin/env python3
"""offload-next-step and host-memory-budget in the memory-budget search.

usage: search_offload.py BIN_DIR SRC_DIR

Compile only (h100 profile), a GPT of 4 layers at width 256, bf16, one
rank, offload=optimizer, memory-budget=1GiB:
(a) with clipping (max-grad-norm=1.0: every host update waits for the
    global norm, so in their own step they start after the backward pass)
    the default offload-next-step=auto chooses next-step: the plan is
    offload-next-step=true's (same predicted step, carried waits in the
    program), faster than offload-next-step=false's, and its strategy
    records the choice and its host arena;
(b) with a host-memory-budget that the next-step plan's host arena
    exceeds and the in-step one meets, the search keeps the updates in
    their step, within the budget;
(c) below the in-step host arena nothing fits, and the error names the
    host budget and the smallest host arena reached;
(d) without clipping the two predict the same step (the host stream
    bounds it either way) and the smaller host arena, in-step, is chosen;
(e) without a memory budget auto means false, a host arena over
    host-memory-budget is an error naming both sizes, and a misspelt
    offload-next-step is refused by name.
Trained: (f) the small GPT at 2 ranks with clipping: the search chooses
next-step, and 4 steps train bitwise like the same schedule with the
updates joined in their step.
(a)-(f) pin offload-prefetch=false. offload-prefetch (next-step false):
(g) auto prefetches on the h100 profile: offload-prefetch=true's plan
    (async copies to the device), faster than false's;
(h) on a tiny GPT whose peak the prefetched copy raises, other knobs
    pinned: a budget between the two arenas keeps the
    copies at their use, one at the larger arena prefetches;
(i) on the cpu profile (copies in place: the same step) the smaller peak
    is chosen, and a misspelt offload-prefetch is refused by name.
Copies in flight (offload-prefetch-depth), on a GPT of 6 layers whose
first 4 are frozen (kept on the device in bf16: only the 2 trainable
shards are copied, at the end of the forward pass):
(j) unpinned, the search tries its fastest prefetching schedules deeper
    and keeps 2 copies in flight, predicted faster than the schedule it
    chooses with 1 pinned; each plan has exactly as many in flight;
(k) on the cpu profile (a tie) it stays at 1; a depth of 0 is refused by
    name.
"""
import json
import os
import subprocess
import sys
import tempfile

from e2e_lib import copies_in_flight
from search_common import pinned_knobs, train_losses


def main():
    bindir, src = sys.argv[1], sys.argv[2]
    failures = []

    def report(ok, what):
        print(f"{what}  {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "gpt.mlir")
        subprocess.run([sys.executable, os.path.join(src, "examples", "gen_models.py"), "gpt",
                        "--vocab", "4096", "--ctx", "256", "--layers", "4", "--heads", "4",
                        "--width", "256", "--batch", "2", "-o", model], check=True)

        def compile_(tag, options, mlir=model, check=True):
            plan = os.path.join(tmp, tag + ".plan")
            r = subprocess.run([os.path.join(bindir, "fsdp-opt"), mlir, "-o", os.devnull,
                                f"--fsdp-pipeline=optimizer=adamw {options} plan={plan} "
                                "report=false"], capture_output=True, text=True)
            if check and r.returncode != 0:
                raise SystemExit(f"fsdp-opt failed ({tag}): {r.stderr}")
            return plan if r.returncode == 0 else r.stderr

        def load(plan):
            return json.load(open(plan))

        def carried(p):
            return sum(1 for i in p["program"] if i["op"] == "wait" and
                       i.get("attrs", {}).get("carried"))

        # (a)-(f) weigh next-step with the copies at their use: a carried
        # join bounds a prefetched copy, so prefetch would tip the scales
        # ((g)-(i) weigh offload-prefetch).
        base = "param-dtype=bf16 memory-budget=1GiB offload=optimizer offload-prefetch=false"
        clip = base + " max-grad-norm=1.0"
        auto, nxt, own = (load(compile_(t, f"{clip}{o}")) for t, o in
                          (("auto", ""), ("next", " offload-next-step=true"),
                           ("own", " offload-next-step=false")))
        sa, sn, so = auto["strategy"], nxt["strategy"], own["strategy"]
        report(sa["offload_next_step"] is True and sa["predicted_step_s"] == sn["predicted_step_s"]
               and sn["predicted_step_s"] < so["predicted_step_s"] and carried(auto) > 0
               and carried(own) == 0 and sa["host_peak"] == auto["host_arena_bytes"],
               f"(a) clipping: chose next-step, predicted {sa['predicted_step_s'] * 1e3:.3f} ms "
               f"against {so['predicted_step_s'] * 1e3:.3f} in-step, {carried(auto)} carried waits")
        h_next, h_own = nxt["host_arena_bytes"], own["host_arena_bytes"]
        if not h_own < h_next:
            raise SystemExit(f"expected next-step's host arena ({h_next}) above in-step's ({h_own})")
        mid = (h_own + h_next) // 2
        b = load(compile_("hostmid", f"{clip} host-memory-budget={mid}"))
        report(b["strategy"]["offload_next_step"] is False and b["host_arena_bytes"] <= mid and
               b["strategy"]["host_budget"] == mid and carried(b) == 0,
               f"(b) host-memory-budget={mid} (host arenas: in-step {h_own}, next-step "
               f"{h_next}): in-step, host arena {b['host_arena_bytes']}")
        err = compile_("hostlow", f"{clip} host-memory-budget={h_own - 1}", check=False)
        report(f"no schedule fits host-memory-budget={h_own - 1}" in err and
               f"({h_own} bytes)" in err,
               "(c) below the in-step host arena: refused, naming the smallest host arena")
        plain, plain_next = (load(compile_(t, f"{base}{o}")) for t, o in
                             (("plain", ""), ("plain-next", " offload-next-step=true")))
        tie = round(plain["strategy"]["predicted_step_s"] * 1e9) == round(
            plain_next["strategy"]["predicted_step_s"] * 1e9)
        report(tie and plain["strategy"]["offload_next_step"] is False and carried(plain) == 0 and
               plain["host_arena_bytes"] < plain_next["host_arena_bytes"],
               "(d) no clipping: the same predicted step, the smaller host arena (in-step)")
        nb = load(compile_("nobudget", "param-dtype=bf16 offload=optimizer max-grad-norm=1.0 "
                           "offload-prefetch=false"))
        err = compile_("nobudget-host", "param-dtype=bf16 offload=optimizer max-grad-norm=1.0 "
                       f"host-memory-budget={nb['host_arena_bytes'] - 1}", check=False)
        err2 = compile_("misspelt", f"{clip} offload-next-step=maybe", check=False)
        report(carried(nb) == 0 and "exceeds host-memory-budget" in err and
               "offload-next-step" in err2 and "maybe" in err2,
               "(e) no budget: in-step; host arena over host-memory-budget and "
               "offload-next-step=maybe refused by name")

        # (f) trained: the search's next-step choice against its in-step twin.
        small = os.path.join(src, "examples", "gpt_small.mlir")
        opts = ("world-size=2 memory-budget=64MiB offload=optimizer max-grad-norm=1.0 "
                "offload-prefetch=false")
        chosen = compile_("small-auto", opts, mlir=small)
        s = load(chosen)["strategy"]
        knobs = ("world-size=2 offload=optimizer max-grad-norm=1.0 offload-prefetch=false " +
                 pinned_knobs(s) + " offload-next-step=false")
        twin = compile_("small-own", knobs, mlir=small)
        a, b = train_losses(bindir, chosen), train_losses(bindir, twin)
        report(s["offload_next_step"] is True and carried(load(chosen)) > 0 and
               carried(load(twin)) == 0 and len(a) == 4 and a == b,
               f"(f) small GPT, 2 ranks: chose next-step; 4 steps bitwise equal to {knobs}")

        # (g)-(i) offload-prefetch, next-step pinned false.
        def async_copies(p):
            return sum(1 for i in p["program"] if i["op"] == "to_device" and
                       i.get("attrs", {}).get("async"))

        pclip = ("param-dtype=bf16 memory-budget=1GiB offload=optimizer max-grad-norm=1.0 "
                 "offload-next-step=false")
        pa, pt, pf = (load(compile_(t, f"{pclip}{o}")) for t, o in
                      (("pf-auto", ""), ("pf-true", " offload-prefetch=true"),
                       ("pf-false", " offload-prefetch=false")))
        sa, st_, sf = pa["strategy"], pt["strategy"], pf["strategy"]
        report(sa["offload_prefetch"] is True and sf["offload_prefetch"] is False and
               sa["predicted_step_s"] == st_["predicted_step_s"] < sf["predicted_step_s"] and
               async_copies(pa) > 0 and async_copies(pf) == 0,
               f"(g) h100 profile: auto prefetches ({async_copies(pa)} async copies), predicted "
               f"{sa['predicted_step_s'] * 1e3:.3f} ms against {sf['predicted_step_s'] * 1e3:.3f} "
               "ms")
        # A model whose parameters the peak holds (width 16, 2 ranks, each
        # unit recomputed and resharded): the prefetched copy raises it.
        # With the other knobs pinned, a budget between the two arenas
        # keeps the copies at their use; one at the larger prefetches.
        tiny = os.path.join(tmp, "tiny.mlir")
        subprocess.run([sys.executable, os.path.join(src, "examples", "gen_models.py"), "gpt",
                        "--vocab", "64", "--ctx", "8", "--layers", "2", "--heads", "2",
                        "--width", "16", "--batch", "4", "-o", tiny], check=True)
        tk = ("world-size=2 stage=3 offload=optimizer max-grad-norm=1.0 offload-next-step=false "
              "layers-per-unit=1 recompute=unit reshard-after-forward=true prefetch-depth=0")
        at, af = (load(compile_(f"tiny-{v}", f"{tk} offload-prefetch={v}", mlir=tiny))["arena_bytes"]
                  for v in ("true", "false"))
        mid = (at + af) // 2
        pm, pt2 = (load(compile_(f"tiny-b{b}", f"{tk} memory-budget={b}", mlir=tiny))
                   for b in (mid, at))
        report(af < at and pm["strategy"]["offload_prefetch"] is False and
               pm["arena_bytes"] == af and async_copies(pm) == 0 and
               pt2["strategy"]["offload_prefetch"] is True and async_copies(pt2) > 0,
               f"(h) arenas {af} B (copies at their use) and {at} B (prefetched): budget {mid} "
               f"keeps the copies at their use, budget {at} prefetches")
        cpu = os.path.join(tmp, "cpu.json")
        with open(cpu, "w") as f:
            json.dump({"name": "cpu-test", "kind": "cpu",
                       "compute": {"gemm_flops_per_s": 1e11, "mem_bytes_per_s": 2e10,
                                   "op_overhead_s": 2e-6, "host_link_bytes_per_s": 1e10}}, f)
        pc = load(compile_("pf-cpu", f"{pclip} device-profile={cpu}"))
        err = compile_("pf-misspelt", f"{pclip} offload-prefetch=maybe", check=False)
        report(pc["strategy"]["offload_prefetch"] is False and async_copies(pc) == 0 and
               "offload-prefetch" in err and "maybe" in err,
               "(i) cpu profile (the device copies in place: a tie): the smaller peak, no "
               "prefetch; offload-prefetch=maybe refused by name")

        # (j)-(k) copies in flight.
        ft = os.path.join(tmp, "frozen4.mlir")
        subprocess.run([sys.executable, os.path.join(src, "examples", "gen_models.py"), "gpt",
                        "--vocab", "4096", "--ctx", "256", "--layers", "6", "--heads", "4",
                        "--width", "256", "--batch", "2", "--frozen-layers", "4", "-o", ft],
                       check=True)
        fk = "param-dtype=bf16 memory-budget=1GiB offload=optimizer frozen-storage=compute"
        da, d1 = (load(compile_(f"depth-{t}", f"{fk}{o}", mlir=ft)) for t, o in
                  (("auto", ""), ("1", " offload-prefetch-depth=1")))
        sa, s1 = da["strategy"], d1["strategy"]
        report(sa["offload_prefetch"] is True and sa["offload_prefetch_depth"] == 2 and
               s1["offload_prefetch_depth"] == 1 and
               sa["predicted_step_s"] < s1["predicted_step_s"] and
               copies_in_flight(da) == 2 and copies_in_flight(d1) == 1,
               f"(j) copies in flight: the search keeps {sa['offload_prefetch_depth']} "
               f"({copies_in_flight(da)} in its plan), predicted "
               f"{sa['predicted_step_s'] * 1e3:.4f} ms against "
               f"{s1['predicted_step_s'] * 1e3:.4f} ms with 1 pinned "
               f"({copies_in_flight(d1)} in its plan)")
        dc = load(compile_("depth-cpu", f"{fk} offload-prefetch=true device-profile={cpu}",
                           mlir=ft))
        err = compile_("depth-0", f"{fk} offload-prefetch-depth=0 offload-prefetch=true",
                       mlir=ft, check=False)
        report(dc["strategy"]["offload_prefetch_depth"] == 1 and copies_in_flight(dc) == 1 and
               "prefetch-depth=0 must be 1 to 8" in err,
               "(k) cpu profile (a tie): 1 copy in flight; offload-prefetch-depth=0 refused by "
               "name")

    if failures:
        print("FAILED:", "; ".join(failures))
        return 1
    print("all offload search checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
