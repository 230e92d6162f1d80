"""Helpers shared by the memory-budget search's end-to-end tests
(search_activations.py, search_offload.py)."""
import json
import os
import subprocess


def pinned_knobs(s):
    """The pipeline options that pin every knob the search chose, from a
    plan's `strategy` (the schedule compiled by hand, without a budget)."""
    knobs = (f"layers-per-unit={s['layers_per_unit']} recompute={s['recompute']} "
             f"reshard-after-forward={'true' if s['reshard_after_forward'] else 'false'} "
             f"prefetch-depth={s['prefetch_depth']} "
             f"backward-prefetch={s['backward_prefetch']} "
             f"reshard-after-backward={'true' if s['reshard_after_backward'] else 'false'}")
    if s["recompute_units"] >= 0:
        knobs += f" recompute-units={s['recompute_units']}"
    if s["reshard_units"] >= 0:
        knobs += f" reshard-units={s['reshard_units']}"
    if s["unit_prefetch_depth"]:
        knobs += f" unit-prefetch-depth={s['unit_prefetch_depth']}"
    return knobs


def train_losses(bindir, plan, nproc=2, steps=4):
    """The per-step losses of `steps` steps of `plan` on `nproc` ranks."""
    out = subprocess.run([os.path.join(bindir, "fsdp-run"), plan, "--json", "--nproc",
                          str(nproc), "--threads", "1", "--steps", str(steps)],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    return [json.loads(l)["loss"] for l in out.splitlines()
            if l.startswith("{") and '"step"' in l and '"loss"' in l]
