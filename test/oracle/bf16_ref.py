#!/usr/bin/env python3
"""The PyTorch oracle for mixed-precision (param-dtype=bf16) plans.

Replays every step of an `fsdp-run --dump-dir` run of a bf16 plan from OUR
f32 parameters before that step (teacher forcing, as torch_ref.py does: no
trajectory divergence compounds) and computes the loss on the same batch in
PyTorch three ways:

  autocast   torch.autocast("cpu", dtype=torch.bfloat16) over the f32
             model, the loss in f32 (CPU autocast runs linear/matmul in
             bf16; relu follows its input's dtype; BCE-with-logits and
             cross-entropy run in f32). For the MLP this is our policy
             exactly, up to where each op rounds: torch's bf16 linear
             rounds x W^T + b once, our plan rounds after the matmul and
             after the bias.
  bf16       the module cast to bf16 (FSDP2's MixedPrecisionPolicy with
             param_dtype=bf16: every op in bf16), the logits cast to f32
             for the loss, as our plan does. For the GPT this is the
             policy that applies (autocast would run layer_norm, softmax
             and GELU on other dtypes than ours).
  float64    the exact loss at the same parameters (information: how far
             bf16 evaluation moves the loss).

Check: our loss at every step equals the oracle of the policy that applies
(mlp: autocast; gpt: bf16) within D u relative, u = 2^-8 the unit roundoff
of bf16 and D the number of forward instructions of the plan that write a
bf16 tensor before the loss: each such rounding may differ between two
implementations by at most u relative, and to first order these add up
(test/e2e/mixed_precision.py gives the same derivation). The bf16 gradient
and update are not compared element by element: a rounding-level gradient
is normalized by AdamW into a +-lr step in either implementation, so a
per-element bound for bf16 gradients would be meaningless; the update
arithmetic itself runs in f32 on f32 shards and is the one torch_ref.py
checks for f32 plans.

usage: bf16_ref.py --model mlp|gpt [model sizes as torch_ref.py] --plan P --dump-dir D
"""
import argparse
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("torch_ref", os.path.join(HERE, "torch_ref.py"))
torch_ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_ref)

# The bound D * u and how D is counted from the plan: one definition, in the
# end-to-end test that uses it too.
_mp_spec = importlib.util.spec_from_file_location(
    "mixed_precision", os.path.join(HERE, "..", "e2e", "mixed_precision.py"))
_mp = importlib.util.module_from_spec(_mp_spec)
_mp_spec.loader.exec_module(_mp)
U, rounding_depth = _mp.U, _mp.rounding_depth


def bf16_loss(model, kind, x, y):
    """The module in bf16 with the loss read in f32 (our plan's policy)."""
    m = model.to(torch.bfloat16)
    if kind == "mlp":
        h = x.to(torch.bfloat16)
        for b in m.layers:
            h = b.out_proj(F.relu(b.in_proj(h)))
        return F.binary_cross_entropy_with_logits(m.head(h).float(), y.float())
    # GPT: the model's own loss with the logits upcast before cross-entropy.
    orig = F.cross_entropy
    try:
        F.cross_entropy = lambda logits, target, *a, **k: orig(logits.float(), target, *a, **k)
        return m.loss(x, y)
    finally:
        F.cross_entropy = orig


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "gpt"], required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--dump-dir", required=True)
    ap.add_argument("--label-smoothing", type=float, default=0.0,
                    help="the cross-entropy's label smoothing (as torch_ref.py)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch_ref.LABEL_SMOOTHING["e"] = args.label_smoothing
    with open(args.plan) as f:
        plan = json.load(f)
    with open(f"{args.dump_dir}/log.json") as f:
        log = json.load(f)
    depth = rounding_depth(plan)
    if depth == 0:
        sys.exit("the plan computes nothing in bf16: compile it with param-dtype=bf16")
    rtol = depth * U
    inputs = [b["name"] for b in plan["inputs"] if b["role"] == "input"]
    targets = [b["name"] for b in plan["inputs"] if b["role"] == "target"]
    batches = torch_ref.read_safetensors(f"{args.dump_dir}/batches.safetensors")
    init = torch_ref.read_safetensors(f"{args.dump_dir}/init.safetensors")
    ours = torch_ref.read_safetensors(f"{args.dump_dir}/trajectory.safetensors")
    check = "autocast" if args.model == "mlp" else "bf16"
    print(f"D = {depth} bf16 roundings before the loss: tolerance D u = {rtol:.4f}; "
          f"checked against the {check} oracle")
    print(f"{'step':>5} {'fsdp-run':>12} {'autocast':>12} {'bf16':>12} {'float64':>12} "
          f"{'rel diff':>9}")
    worst = 0.0
    worst64 = 0.0
    theta = init
    for step in range(1, log["steps"] + 1):
        x = batches[f"step{step}.{inputs[0]}"]
        y = batches[f"step{step}.{targets[0]}"]
        losses = {}
        with torch.no_grad():
            m = torch_ref.build(args)
            torch_ref.load_init(m, theta)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses["autocast"] = m.loss(x, y).float().item()
            m64 = torch_ref.build(args).double()
            torch_ref.load_init(m64, theta)
            xd, yd = (x.double(), y.double()) if x.is_floating_point() else (x, y)
            losses["float64"] = m64.loss(xd, yd).item()
            losses["bf16"] = bf16_loss(m, args.model, x, y).item()
        got = log["losses"][step - 1]
        rel = abs(got - losses[check]) / abs(losses[check])
        worst = max(worst, rel)
        worst64 = max(worst64, abs(got - losses["float64"]) / abs(losses["float64"]))
        print(f"{step:>5} {got:>12.6f} {losses['autocast']:>12.6f} {losses['bf16']:>12.6f} "
              f"{losses['float64']:>12.6f} {rel:>9.2e}")
        theta = {n: ours[f"step{step}.{n}"] for n in init}
    print(f"our bf16 loss vs PyTorch {check}, every step from our parameters: max relative "
          f"difference {worst:.2e} (bound {rtol:.4f}); vs float64 {worst64:.2e} (information)")
    ok = worst <= rtol
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
