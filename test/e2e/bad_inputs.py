#!/usr/bin/env python3
"""Bad inputs get a clear error, never a crash, a hang or a silent success.

Runs fsdp-run on hostile variants of valid plans (wrong JSON types,
overflowing offsets and sizes, inconsistent dtypes, hostile nesting, ...),
bad options, bad data and checkpoint files and a bad environment. Every
case must exit with status 1 or 2 (not a signal, not 0) within a timeout,
print "fsdp-run: error" and name the problem (a substring given per case).

usage: bad_inputs.py BIN_DIR MLP_PLAN GPT_PLAN SHARDED_PLAN [LLAMA_PLAN [OFFLOAD_PLAN
                     [UNFUSED_GPT_PLAN [LAMB_PLAN [NEXT_STEP_PLAN]]]]]

MLP_PLAN: a one-rank MLP plan (adamw); GPT_PLAN: a one-rank GPT plan
(token inputs, fused kernels, packed attention, clipping folded into the
updates as grad_scale); SHARDED_PLAN: a 2-rank stage-2 MLP plan
(shard views with a rank stride); LLAMA_PLAN: a one-rank Llama plan (rope,
rms_norm, grouped-query attention with 4 heads over 2 key/value heads);
OFFLOAD_PLAN: a one-rank stage-3 MLP plan with offload=optimizer (a host
arena); UNFUSED_GPT_PLAN: the GPT plan with fuse-epilogues=false (slices, the
cross-entropy and its gradient as two ops); LAMB_PLAN: a one-rank MLP plan
with optimizer=lamb, clipping and weight-decay-params=matrices (lamb_norms
and lamb_update with segments, decay_numel and grad_scale); NEXT_STEP_PLAN:
the offload plan with clipping and offload-next-step=true (carried waits).
Without the optional plans their cases are skipped, and the
summary says so.
"""
import copy
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile

I64_MAX = 2 ** 63 - 1


def first(plan, op):
    return next(i for i in plan["program"] if i["op"] == op)


def narrow(plan, buffer):
    """Buffer `buffer` stored in bf16 (half its bytes, where it was)."""
    b = next(x for x in plan["buffers"] if x["id"] == buffer)
    b.update(dtype="bf16", bytes=b["bytes"] // 2)


def to_i8(plan, buffer):
    """Buffer `buffer` stored as i8 (a byte an element, where it was)."""
    b = next(x for x in plan["buffers"] if x["id"] == buffer)
    b.update(dtype="i8", bytes=b["bytes"] // 4)


def eight_bit(plan, op="adamw_update", **attrs):
    """The first `op`'s moments, in and out (lamb_norms: in), as i8 of an
    element's byte each (not the packed size of 8-bit moments), with
    `attrs`."""
    u = first(plan, op)
    for buf in {u["in"][2], u["in"][3]} | ({u["out"][1], u["out"][2]} if len(u["out"]) > 1 else set()):
        to_i8(plan, buf)
    u["attrs"].update(attrs)


def view(plan):
    return next(b for b in plan["buffers"] if b.get("rank_stride"))


def int_input(plan):
    return next(b for b in plan["inputs"] if b["role"] == "input")


def buf(plan, binding):
    return plan["buffers"][binding["buffer"]]


def overlap_two(plan):
    """Moves one transient buffer onto another that is live at the same time."""
    aliased = {b["alias_of"] for b in plan["buffers"] if b.get("alias_of", -1) >= 0}
    owners = [b for b in plan["buffers"] if not b["persistent"]
              and b.get("alias_of", -1) < 0 and b["id"] not in aliased and b["bytes"] > 0]
    for a in owners:
        for b in owners:
            if a is not b and a["first"] <= b["last"] and b["first"] <= a["last"] \
                    and b["bytes"] <= a["bytes"]:
                b["offset"] = a["offset"]
                return
    raise SystemExit("no two transient buffers live at once")


def host_buf(plan):
    return next(b for b in plan["buffers"] if b.get("space") == "host")


def carried(plan):
    """The first carried wait's index and the index of the update it joins."""
    prog = plan["program"]
    w = next(k for k, i in enumerate(prog) if i.get("attrs", {}).get("carried"))
    u = next(k for k, i in enumerate(prog) if k > w and i["op"] == "adamw_update"
             and i["out"][0] == prog[w]["in"][0])
    return w, u


def carried_after_first_use(p):
    """Swaps the first carried wait with the instruction after it (the first
    to touch what its update does), widening that one's buffers' live ranges
    to its new place."""
    w, _ = carried(p)
    prog = p["program"]
    prog[w], prog[w + 1] = prog[w + 1], prog[w]
    for b in prog[w]["in"] + prog[w]["out"]:
        if not p["buffers"][b].get("persistent"):
            p["buffers"][b]["first"] = min(p["buffers"][b]["first"], w)


def join_carried_in_its_step(p):
    """A wait on the joined update's buffer right after it, in place of
    the instruction there (no index moves), or last."""
    u = carried(p)[1]
    b = p["program"][u]["out"][0]
    w = {"op": "wait", "in": [b], "out": [b], "attrs": {}}
    if u + 1 < len(p["program"]):
        p["program"][u + 1] = w
    else:
        p["program"].append(w)


def carried_grad_live_from_its_copy(p):
    """The joined update's gradient live only from its copy to the host."""
    prog = p["program"]
    g = prog[carried(p)[1]]["in"][1]
    p["buffers"][g]["first"] = next(k for k, i in enumerate(prog) if g in i["out"])


def copy_stream_join(plan):
    """The first carried wait joining on the copy stream, and the index of
    the wait of the copy after it."""
    prog = plan["program"]
    w = next(k for k, i in enumerate(prog) if i.get("attrs", {}).get("copy_stream"))
    out = prog[w + 1]["out"][0]
    return w, next(k for k in range(w + 2, len(prog))
                   if prog[k]["op"] == "wait" and prog[k]["in"][0] == out)


def copy_stream_copy_on_compute(p):
    """The copy after a copy-stream join made synchronous (compute's)."""
    p["program"][copy_stream_join(p)[0] + 1]["attrs"]["async"] = False


def copy_stream_join_compute_read(p):
    """Between a copy-stream join and its copy's wait, another copy of the
    joined unit's storage made synchronous (a compute read of it)."""
    prog = p["program"]
    w, j = copy_stream_join(p)
    def root(b):
        a = p["buffers"][b].get("alias_of", -1)
        return a if a >= 0 else b
    unit = root(prog[w]["in"][0])
    k = next(k for k in range(w + 2, j)
             if prog[k]["op"] == "to_device" and root(prog[k]["in"][0]) == unit)
    prog[k]["attrs"]["async"] = False


def async_copy_read_before_wait(p):
    """The first async copy to the device whose wait is right before its
    reader: the two swapped, so the reader reads the copy's output while
    the copy stream may still write it ([Note: async windows])."""
    prog = p["program"]
    for i, c in enumerate(prog):
        if c["op"] != "to_device" or not c.get("attrs", {}).get("async"):
            continue
        j = next(k for k in range(i + 1, len(prog))
                 if prog[k]["op"] == "wait" and prog[k]["in"][0] == c["out"][0])
        if j + 1 < len(prog) and c["out"][0] in prog[j + 1]["in"]:
            prog[j], prog[j + 1] = prog[j + 1], prog[j]
            for b in prog[j]["in"] + prog[j]["out"]:
                if not p["buffers"][b].get("persistent"):
                    p["buffers"][b]["first"] = min(p["buffers"][b]["first"], j)
            return
    raise SystemExit("no async copy read right after its wait")


def async_input_freed_at_issue(p):
    """The first async collective whose transient input nothing after it
    reads: its live range cut to end at the issue, so another buffer could
    take its bytes while the comm stream still reads them."""
    prog, bufs = p["program"], p["buffers"]
    for i, c in enumerate(prog):
        if c["op"] not in ("all_gather", "reduce_scatter", "all_reduce") \
                or not c.get("attrs", {}).get("async"):
            continue
        b = bufs[c["in"][0]]
        if b["persistent"] or b.get("alias_of", -1) >= 0 or b["last"] <= i:
            continue
        if any(b["id"] in x["in"] + x["out"] for x in prog[i + 1:]):
            continue
        b["last"] = i
        return
    raise SystemExit("no async collective with a transient input read only by it")


def setter(fn):
    """A mutation that edits a deep copy of the plan."""
    def apply(plan):
        p = copy.deepcopy(plan)
        fn(p)
        return p
    return apply


# (name, which plan, mutation, expected substring of the error)
PLAN_CASES = [
    # wrong JSON types
    ("buffers is an object", "mlp", setter(lambda p: p.update(buffers={"a": 1})), "buffers: expected an array"),
    ("a buffer is a string", "mlp", setter(lambda p: p["buffers"].__setitem__(0, "x")), "buffers[0]: expected an object"),
    ("trainable is a string", "mlp", setter(lambda p: p["params"][0].update(trainable="yes")), "trainable: expected true or false"),
    ("program[0].in is a string", "mlp", setter(lambda p: p["program"][0].update({"in": "3"})), "program[0].in"),
    ("version is a string", "mlp", setter(lambda p: p.update(version="1")), "version: expected an integer"),
    ("version 2^32+1", "mlp", setter(lambda p: p.update(version=2 ** 32 + 1)), "newer than this runtime"),
    ("version 1.9", "mlp", setter(lambda p: p.update(version=1.9)), "version: expected an integer"),
    ("requires a feature this runtime lacks", "mlp", setter(lambda p: p.update(requires=["optimizer-state-fp4"])), "plan requires the feature 'optimizer-state-fp4', which this runtime does not have (it has: optimizer-state-bf16, optimizer-state-8bit, optimizer-state-4bit, master-bf16)"),
    ("requires is a string", "mlp", setter(lambda p: p.update(requires="optimizer-state-bf16")), "requires: expected an array of feature names"),
    ("requires holds a number", "mlp", setter(lambda p: p.update(requires=[3])), "requires: expected feature names"),
    ("world_size 2.5", "mlp", setter(lambda p: p.update(world_size=2.5)), "world_size"),
    ("world_size 2^62", "mlp", setter(lambda p: p.update(world_size=2 ** 62)), "world_size"),
    ("arena_bytes 3524.5", "mlp", setter(lambda p: p.update(arena_bytes=3524.5)), "arena_bytes"),
    ("arena_bytes 2^62", "mlp", setter(lambda p: p.update(arena_bytes=2 ** 62)), "arena_bytes"),
    ("attrs is an array", "mlp", setter(lambda p: first(p, "matmul").update(attrs=[1])), "attrs: expected an object"),
    ("units is a number", "mlp", setter(lambda p: p.update(units=3)), "units: expected an array"),
    ("range is a string", "gpt", setter(lambda p: int_input(p).update(range="x")), "range"),
    ("memory is an array", "mlp", setter(lambda p: p.update(memory=[1])), "memory: expected an object"),
    ("transpose_rhs \"yes\"", "mlp", setter(lambda p: first(p, "matmul")["attrs"].update(transpose_rhs="yes")), "transpose_rhs: expected true or false"),
    ("async \"yes\"", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update({"async": "yes"})), "async"),
    ("heads 2.5", "gpt", setter(lambda p: first(p, "attention_qkv")["attrs"].update(heads=2.5)), "heads"),
    ("attention_qkv kv_heads 3 of 4 heads", "gpt", setter(lambda p: first(p, "attention_qkv")["attrs"].update(kv_heads=3)), "expected kv_heads to divide heads = 4"),
    ("attention_qkv on q alone", "gpt", setter(lambda p: first(p, "attention_qkv")["in"].__setitem__(0, first(p, "attention_qkv")["out"][0])), "expected qkv (q, k, v side by side) of shape"),
    ("attention_qkv_grad lse of y's shape", "gpt", setter(lambda p: first(p, "attention_qkv_grad")["in"].__setitem__(2, first(p, "attention_qkv_grad")["in"][1])), "expected lse of shape"),
    ("attention_qkv_grad without lse", "gpt", setter(lambda p: first(p, "attention_qkv_grad")["in"].pop(2)), "attention_qkv_grad: expected 4 inputs and 1 outputs, found 3"),
    ("kv_heads 2.5", "llama", setter(lambda p: first(p, "attention")["attrs"].update(kv_heads=2.5)), "kv_heads: expected an integer"),
    ("kv_heads 3 of 4 heads", "llama", setter(lambda p: first(p, "attention")["attrs"].update(kv_heads=3)), "expected kv_heads to divide heads = 4"),
    ("kv_heads dropped", "llama", setter(lambda p: first(p, "attention_grad")["attrs"].pop("kv_heads")), "expected k of shape"),
    ("attention_grad without y and lse (an older plan)", "llama", setter(lambda p: first(p, "attention_grad").update(**{"in": first(p, "attention_grad")["in"][:3] + first(p, "attention_grad")["in"][5:]})), "attention_grad: expected 6 inputs and 3 outputs, found 4"),
    ("matmul accumulator of the wrong shape", "mlp", setter(lambda p: first(p, "matmul")["in"].append(first(p, "matmul")["in"][0])), "matmul: expected an accumulator of shape"),
    ("matmul with four inputs", "mlp", setter(lambda p: first(p, "matmul")["in"].extend(first(p, "matmul")["out"] * 2)), "matmul"),
    ("matmul_bias pre-activation without gelu", "gpt", setter(lambda p: next(i for i in p["program"] if i["op"] == "matmul_bias" and len(i["out"]) == 2)["attrs"].pop("gelu")), "a pre-activation output needs the gelu attribute"),
    ("matmul_gelu_grad bias gradient of the wrong shape", "gpt", setter(lambda p: first(p, "matmul_gelu_grad")["out"].__setitem__(1, first(p, "matmul_gelu_grad")["out"][0])), "matmul_gelu_grad: expected a bias gradient of shape"),
    ("matmul_bias_grad without transpose_lhs", "gpt", setter(lambda p: first(p, "matmul_bias_grad")["attrs"].pop("transpose_lhs")), "matmul_bias_grad: expected transpose_lhs and not transpose_rhs"),
    ("matmul_bias_grad with one accumulator", "gpt", setter(lambda p: first(p, "matmul_bias_grad")["in"].append(first(p, "matmul_bias_grad")["out"][0])), "matmul_bias_grad: expected two accumulators"),
    ("matmul_bias_grad bias accumulator of the wrong shape", "gpt", setter(lambda p: first(p, "matmul_bias_grad")["in"].extend(first(p, "matmul_bias_grad")["out"][:1] * 2)), "matmul_bias_grad: expected a bias accumulator of shape"),
    ("matmul_bias_grad bias gradient of the wrong shape", "gpt", setter(lambda p: first(p, "matmul_bias_grad")["out"].__setitem__(1, first(p, "matmul_bias_grad")["out"][0])), "matmul_bias_grad: expected a bias gradient of shape"),
    ("residual_layer_norm without its sum output", "gpt", setter(lambda p: first(p, "residual_layer_norm")["out"].pop(0)), "residual_layer_norm: expected 4 inputs and 2 outputs, found 4 and 1"),
    ("lse of q's shape", "llama", setter(lambda p: first(p, "attention_grad")["in"].__setitem__(4, first(p, "attention_grad")["in"][0])), "expected lse of shape"),
    ("theta \"1e4\"", "llama", setter(lambda p: first(p, "rope")["attrs"].update(theta="1e4")), "theta: expected a finite number"),
    ("theta missing", "llama", setter(lambda p: first(p, "rope_grad")["attrs"].pop("theta")), "missing attribute theta"),
    ("theta 0.5", "llama", setter(lambda p: first(p, "rope")["attrs"].update(theta=0.5)), "expected a number > 1"),
    ("rope heads of odd size", "llama", setter(lambda p: first(p, "rope")["attrs"].update(heads=64)), "heads of even size"),
    ("epsilon -1e-5", "llama", setter(lambda p: first(p, "rms_norm")["attrs"].update(epsilon=-1e-5)), "epsilon: expected a positive number"),
    ("epsilon missing", "llama", setter(lambda p: first(p, "rms_norm_grad")["attrs"].pop("epsilon")), "missing attribute epsilon"),
    ("cast stochastic f32 -> f32", "mlp", setter(lambda p: first(p, "relu").update(op="cast", attrs={"stochastic": True, "key": 0})), "stochastic rounding converts f32 to bf16, found f32 -> f32"),
    ("cast key without stochastic", "mlp", setter(lambda p: first(p, "relu").update(op="cast", attrs={"key": 0})), "`key` and `sharded` belong to stochastic rounding"),
    ("cast stochastic \"yes\"", "mlp", setter(lambda p: first(p, "relu").update(op="cast", attrs={"stochastic": "yes"})), "stochastic: expected true or false"),
    ("dropout p 1.5", "mlp", setter(lambda p: first(p, "relu").update(op="dropout", attrs={"p": 1.5, "id": 0})), "dropout: p must be in [0, 1)"),
    ("dropout p \"0.1\"", "mlp", setter(lambda p: first(p, "relu").update(op="dropout", attrs={"p": "0.1", "id": 0})), "p: expected a finite number"),
    ("dropout without id", "mlp", setter(lambda p: first(p, "relu").update(op="dropout", attrs={"p": 0.1})), "dropout: missing attribute id"),
    ("dropout micro 2 of 2", "mlp", setter(lambda p: first(p, "relu").update(op="dropout", attrs={"p": 0.1, "id": 0, "micro": 2, "micro_count": 2})), "micro must be in [0, micro_count)"),
    ("options is a string", "mlp", setter(lambda p: p.update(options="x")), "options: expected an object"),
    # overflow and bounds
    ("buffer offset INT64_MAX", "mlp", setter(lambda p: p["buffers"][3].update(offset=I64_MAX)), "offset"),
    ("buffer offset near the arena end", "mlp", setter(lambda p: p["buffers"][3].update(offset=p["arena_bytes"] - 4)), "outside the arena"),
    ("buffer bytes -1", "mlp", setter(lambda p: p["buffers"][3].update(bytes=-1)), "bytes"),
    ("shape [2^62, 4]", "mlp", setter(lambda p: p["buffers"][3].update(shape=[2 ** 62, 4])), "shape"),
    ("shape [2^31, 2^31, 2^31]", "mlp", setter(lambda p: p["buffers"][3].update(shape=[2 ** 31] * 3)), "shape"),
    ("a negative dimension", "mlp", setter(lambda p: p["buffers"][3].update(shape=[-4, 2])), "shape"),
    ("rank 9 shape", "mlp", setter(lambda p: p["buffers"][3].update(shape=[1] * 9)), "shape"),
    ("param flat_offset INT64_MAX", "sharded", setter(lambda p: p["params"][0].update(flat_offset=I64_MAX)), "flat_offset"),
    ("param flat_offset past its unit", "sharded", setter(lambda p: p["params"][0].update(flat_offset=10 ** 9)), "does not fit its unit"),
    ("slice offset INT64_MAX", "gpt_unfused", setter(lambda p: first(p, "slice")["attrs"].update(offset=I64_MAX)), "out of bounds"),
    ("cross_entropy classes 0", "gpt_unfused", setter(lambda p: first(p, "cross_entropy")["attrs"].update(classes=0)), "classes = 0 must lie in [1, 256]"),
    ("cross_entropy_grad classes past the logits", "gpt_unfused", setter(lambda p: first(p, "cross_entropy_grad")["attrs"].update(classes=257)), "classes = 257 must lie in [1, 256]"),
    ("cross_entropy classes \"251\"", "gpt_unfused", setter(lambda p: first(p, "cross_entropy")["attrs"].update(classes="251")), "classes: expected an integer"),
    ("cross_entropy_fused classes 0", "gpt", setter(lambda p: first(p, "cross_entropy_fused")["attrs"].update(classes=0)), "classes = 0 must lie in [1, 256]"),
    ("cross_entropy_fused label_smoothing 1.5", "gpt", setter(lambda p: first(p, "cross_entropy_fused")["attrs"].update(label_smoothing=1.5)), "label_smoothing = 1.5 must lie in [0, 1]"),
    ("cross_entropy_grad label_smoothing -0.1", "gpt_unfused", setter(lambda p: first(p, "cross_entropy_grad")["attrs"].update(label_smoothing=-0.1)), "label_smoothing = -0.1 must lie in [0, 1]"),
    ("cross_entropy label_smoothing \"0.1\"", "gpt_unfused", setter(lambda p: first(p, "cross_entropy")["attrs"].update(label_smoothing="0.1")), "label_smoothing: expected a finite number"),
    ("cross_entropy_fused gradient of the loss's shape", "gpt", setter(lambda p: first(p, "cross_entropy_fused")["out"].__setitem__(1, first(p, "cross_entropy_fused")["out"][0])), "cross_entropy_fused: expected a result of shape"),
    ("cross_entropy_fused loss of the logits' shape", "gpt", setter(lambda p: first(p, "cross_entropy_fused")["out"].__setitem__(0, first(p, "cross_entropy_fused")["in"][0])), "cross_entropy_fused: expected a scalar loss"),
    ("cross_entropy_fused without its seed", "gpt", setter(lambda p: first(p, "cross_entropy_fused")["in"].pop(2)), "cross_entropy_fused: expected 3-4 inputs and 2 outputs, found 2"),
    ("cross_entropy_fused ignore_index without its count", "gpt", setter(lambda p: first(p, "cross_entropy_fused")["attrs"].update(ignore_index=-100)), "ignore_index needs the kept-label count input"),
    ("cross_entropy_fused count without ignore_index", "gpt", setter(lambda p: first(p, "cross_entropy_fused")["in"].append(first(p, "cross_entropy_fused")["in"][2])), "a normalizer input without ignore_index"),
    ("cross_entropy_fused ignore_index 2^40", "gpt", setter(lambda p: (first(p, "cross_entropy_fused")["attrs"].update(ignore_index=2 ** 40), first(p, "cross_entropy_fused")["in"].append(first(p, "cross_entropy_fused")["in"][2]))), "ignore_index = 1099511627776 does not fit 32 bits"),
    ("cross_entropy_grad ignore_index \"-100\"", "gpt_unfused", setter(lambda p: (first(p, "cross_entropy_grad")["attrs"].update(ignore_index="-100"), first(p, "cross_entropy_grad")["in"].append(first(p, "cross_entropy_grad")["in"][2]))), "ignore_index: expected an integer"),
    ("cross_entropy_grad count of the logits' shape", "gpt_unfused", setter(lambda p: (first(p, "cross_entropy_grad")["attrs"].update(ignore_index=-100), first(p, "cross_entropy_grad")["in"].append(first(p, "cross_entropy_grad")["in"][0]))), "a scalar normalizer"),
    ("cross_entropy_fused two counts", "gpt", setter(lambda p: (first(p, "cross_entropy_fused")["attrs"].update(ignore_index=-100), first(p, "cross_entropy_fused")["in"].extend([first(p, "cross_entropy_fused")["in"][2]] * 2))), "cross_entropy_fused: expected 3-4 inputs"),
    # LAMB's layout (segments, decay_numel at a parameter's bound, the sums' size)
    ("lamb segments not rising", "lamb", setter(lambda p: first(p, "lamb_norms")["attrs"].update(segments=[0, 5, 5, 9])), "segments must rise strictly from 0"),
    ("lamb segments 5000 entries", "lamb", setter(lambda p: first(p, "lamb_update")["attrs"].update(segments=list(range(5000)))), "an array of at most 4096 integers"),
    ("lamb segments missing", "lamb", setter(lambda p: first(p, "lamb_update")["attrs"].pop("segments")), "missing attribute segments"),
    ("lamb decay_numel inside a parameter", "lamb", setter(lambda p: first(p, "lamb_norms")["attrs"].update(decay_numel=1)), "falls inside parameter 0"),
    ("lamb_update sums of the wrong size", "lamb", setter(lambda p: first(p, "lamb_update")["in"].__setitem__(4, first(p, "lamb_update")["in"][5])), "per-parameter sums"),
    ("lamb_norms marked skip_nonfinite", "lamb", setter(lambda p: first(p, "lamb_norms")["attrs"].update(skip_nonfinite=True)), "skip_nonfinite is lamb_update's"),
    ("lamb shard_stride 3", "lamb", setter(lambda p: first(p, "lamb_update")["attrs"].update(shard_stride=3)), "shard_stride must be 0"),
    # LAMB's 8-bit moments (optimizer-state-dtype=8bit): as adamw_update's
    ("lamb_norms 8-bit moments of the wrong size", "lamb", setter(lambda p: eight_bit(p, "lamb_norms", state_block=256)), "lamb_norms: 8-bit state of"),
    ("lamb_norms i8 moments without state_block", "lamb", setter(lambda p: eight_bit(p, "lamb_norms")), "lamb_norms: i8 state is 8-bit block codes: expected state_block"),
    ("lamb_update f32 moments with state_block", "lamb", setter(lambda p: first(p, "lamb_update")["attrs"].update(state_block=256)), "lamb_update: state_block is for i8 state, found f32"),
    ("slice offset -1", "gpt_unfused", setter(lambda p: first(p, "slice")["attrs"].update(offset=-1)), "out of bounds"),
    ("negative rank_stride", "sharded", setter(lambda p: view(p).update(rank_stride=-16640)), "rank_stride"),
    ("huge rank_stride", "sharded", setter(lambda p: view(p).update(rank_stride=2 ** 47)), "outside the arena"),
    ("rank_stride on a non-view", "mlp", setter(lambda p: p["buffers"][3].update(rank_stride=4)), "rank stride but is not a view"),
    ("alias_of out of range", "sharded", setter(lambda p: view(p).update(alias_of=10 ** 6)), "view of an invalid buffer"),
    ("buffer id out of range", "mlp", setter(lambda p: p["program"][0]["in"].__setitem__(0, 10 ** 6)), "unknown buffer"),
    ("unit shard_numel * world overflows", "sharded", setter(lambda p: p["units"][0].update(shard_numel=2 ** 47)), "inconsistent sizes"),
    # the mesh (the "sharded" plan is 2 ranks, 1-D)
    ("mesh 3x2 for 2 ranks", "sharded", setter(lambda p: p.update(mesh={"replicas": 3, "shards": 2})), "does not hold world_size"),
    ("mesh is a number", "sharded", setter(lambda p: p.update(mesh=4)), "mesh: expected an object"),
    ("mesh shards 0", "sharded", setter(lambda p: p.update(mesh={"replicas": 2, "shards": 0})), "shards"),
    ("mesh 2x1 for a 2-shard plan", "sharded", setter(lambda p: p.update(mesh={"replicas": 2, "shards": 1})), "inconsistent sizes"),
    ("collective group \"row\"", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(group="row")), "attribute group"),
    ("collective group 7", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(group=7)), "attribute group"),
    ("all_gather over the 1-rank replica group", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(group="replica")), "do not fit 1 rank(s)"),
    # the reshard group (reshard-after-forward=G): 1 < G < shards, so a 2-shard plan has none
    ("mesh reshard 2 of 2 shards", "sharded", setter(lambda p: p.update(mesh={"replicas": 1, "shards": 2, "reshard": 2})), "mesh reshard group of 2 ranks"),
    ("mesh reshard -1", "sharded", setter(lambda p: p.update(mesh={"replicas": 1, "shards": 2, "reshard": -1})), "reshard"),
    # hierarchical qgZ's node size: 1 < L < shards, dividing them
    ("mesh node 2 of 2 shards", "sharded", setter(lambda p: p.update(mesh={"replicas": 1, "shards": 2, "node": 2})), "mesh node of 2 ranks"),
    ("all_gather over a missing node group", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(group="cross")), "attribute group"),
    # [Note: node comm stream]: only the node group's collectives on the second stream
    ("all_gather on the node comm stream", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(stream="node")), "\"node\" is for group node only"),
    ("collective stream \"fast\"", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(stream="fast")), "attribute stream"),
    ("collective stream 1", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(stream=1)), "attribute stream"),
    ("rank_period without a reshard group", "sharded", setter(lambda p: view(p).update(rank_period=2)), "rank_period 2"),
    ("all_gather over a missing reshard group", "sharded", setter(lambda p: first(p, "all_gather")["attrs"].update(group="reshard")), "attribute group"),
    # dtypes
    # bf16 moments (optimizer-state-dtype=bf16): AdamW's moments only, both in one dtype, and
    # stochastic rounding needs its key
    ("an unknown state kind in bf16", "mlp", setter(lambda p: (p["states"][0].update(kind="trust_ratio"), narrow(p, p["states"][0]["buffer"]))), "keeps optimizer state in f32 (AdamW's moments and SGD's momentum buffer in f32, bf16 or 8-bit codes)"),
    ("adamw_update with one bf16 moment", "mlp", setter(lambda p: narrow(p, first(p, "adamw_update")["in"][2])), "(both moments in one dtype)"),
    ("adamw_update bf16 moments, stochastic without a key", "mlp", setter(lambda p: (narrow(p, first(p, "adamw_update")["in"][2]), narrow(p, first(p, "adamw_update")["in"][3]), first(p, "adamw_update")["attrs"].update(stochastic=True))), "stochastic needs an integer key >= 0"),
    # 8-bit moments (optimizer-state-dtype=8bit): the packed size, state_block
    ("adamw_update 8-bit moments of the wrong size", "mlp", setter(lambda p: eight_bit(p, state_block=256)), "bytes; operand 2 has"),
    ("adamw_update i8 moments without state_block", "mlp", setter(lambda p: eight_bit(p)), "i8 state is 8-bit block codes: expected state_block"),
    ("adamw_update state_block 100", "mlp", setter(lambda p: eight_bit(p, state_block=100)), "state_block must be a power of two in [32, 4096]"),
    ("adamw_update f32 moments with state_block", "mlp", setter(lambda p: first(p, "adamw_update")["attrs"].update(state_block=256)), "state_block is for i8 state, found f32"),
    # 4-bit moments (optimizer-state-dtype=4bit): state_bits, AdamW only, the
    # plan's feature both ways
    ("adamw_update state_bits 2", "mlp", setter(lambda p: eight_bit(p, state_block=256, state_bits=2)), "adamw_update: state_bits must be 4 (absent: 8), found 2"),
    ("adamw_update 4-bit moments without the plan's feature", "mlp", setter(lambda p: eight_bit(p, state_block=256, state_bits=4)), "4-bit state in a plan that does not require optimizer-state-4bit"),
    ("adamw_update 8-bit moments in a 4-bit plan", "mlp", setter(lambda p: (eight_bit(p, state_block=256), p.update(requires=["optimizer-state-4bit"]))), "8-bit state in a plan that requires optimizer-state-4bit"),
    ("adamw_update f32 moments with state_bits", "mlp", setter(lambda p: first(p, "adamw_update")["attrs"].update(state_bits=4)), "state_bits is for i8 state, found f32"),
    ("lamb_norms 4-bit moments", "lamb", setter(lambda p: (eight_bit(p, "lamb_norms", state_block=256, state_bits=4), p.update(requires=["optimizer-state-4bit"]))), "lamb_norms: 4-bit state (state_bits = 4) is adamw_update's only"),
    ("adamw_update 8-bit moments, stochastic", "mlp", setter(lambda p: eight_bit(p, state_block=256, stochastic=True, key=0)), "stochastic rounds the state to bf16, but it is i8"),
    ("adamw_update f32 moments, stochastic", "mlp", setter(lambda p: first(p, "adamw_update")["attrs"].update(stochastic=True, key=0)), "stochastic rounds the state to bf16, but it is f32"),
    ("param and buffer bf16", "mlp", setter(lambda p: (p["params"][0].update(dtype="bf16"),
                                                     buf(p, {"buffer": p["params"][0]["buffer"]}).update(dtype="bf16"))), "shape x dtype needs"),
    ("param bf16 over an f32 buffer", "mlp", setter(lambda p: p["params"][0].update(dtype="bf16")), "f32"),
    # optimizer offload: the host arena (a 1-rank stage-3 MLP plan, offload=optimizer)
    ("buffer space \"gpu\"", "offload", setter(lambda p: host_buf(p).update(space="gpu")), "space: 'gpu'"),
    ("host_arena_bytes -1", "offload", setter(lambda p: p.update(host_arena_bytes=-1)), "host_arena_bytes"),
    ("host_arena_bytes 64", "offload", setter(lambda p: p.update(host_arena_bytes=64)), "reaches outside the host arena of 64 bytes"),
    ("offloaded unit flag dropped", "offload", setter(lambda p: p["units"][0].pop("offloaded")), "is not offloaded but its storage is in host memory"),
    ("to_host writing device memory", "offload", setter(lambda p: first(p, "to_host")["out"].__setitem__(0, first(p, "to_host")["in"][0])), "is in device memory"),
    ("a host buffer moved to the device arena", "offload", setter(lambda p: p["buffers"][first(p, "to_host")["out"][0]].pop("space")), "reaches outside the arena"),
    ("matmul reading host memory", "offload", setter(lambda p: first(p, "matmul")["in"].__setitem__(1, first(p, "to_device")["in"][0])), "is in host memory"),
    # the offloaded update on the host stream: async only where a stream can run it, and joined
    ("a device matmul marked async", "offload", setter(lambda p: first(p, "matmul")["attrs"].update({"async": True})), "async is for collectives, copies"),
    ("a host update's async dropped, its wait kept", "offload", setter(lambda p: first(p, "adamw_update")["attrs"].pop("async")), "no collective, copy or host update writing it is in flight"),
    # fsdp-offload's nvme: optimizer state in the swap file ([Note: swap file])
    ("nvme_bytes 4096", "nvme", setter(lambda p: p.update(nvme_bytes=4096)), "reaches outside the swap file of 4096 bytes"),
    ("nvme_bytes 64 (not whole blocks)", "nvme", setter(lambda p: p.update(nvme_bytes=64)), "nvme_bytes 64 is not a multiple of the plan's swap_alignment 4096"),
    ("swap_alignment 3", "nvme", setter(lambda p: p.update(swap_alignment=3)), "swap_alignment 3 is not a power of two"),
    ("swap_alignment 2^30", "nvme", setter(lambda p: p.update(swap_alignment=1 << 30)), "swap_alignment"),
    ("a staging buffer off its block", "nvme", setter(lambda p: p["buffers"][first(p, "adamw_update")["attrs"]["swap"][0][1]].update(offset=p["buffers"][first(p, "adamw_update")["attrs"]["swap"][0][1]]["offset"] - 64)), "not a multiple of the plan's swap_alignment"),
    ("swap-file state off its block", "nvme", setter(lambda p: p["buffers"][first(p, "adamw_update")["attrs"]["swap"][0][0]].update(offset=p["buffers"][first(p, "adamw_update")["attrs"]["swap"][0][0]]["offset"] + 64)), "not a multiple of the plan's swap_alignment"),
    ("buffer space \"nvme\" on a parameter", "nvme", setter(lambda p: p["buffers"][p["units"][0]["buffer"]].update(space="nvme", offset=0)), "is a view outside the swap file of buffer"),
    ("an update naming its swap-file state", "nvme", setter(lambda p: first(p, "adamw_update")["in"].__setitem__(2, first(p, "adamw_update")["attrs"]["swap"][0][0])), "which is in the swap file"),
    ("swap entry of two fields", "nvme", setter(lambda p: first(p, "adamw_update")["attrs"]["swap"].__setitem__(0, [1, 2])), "expected [file, staging, write]"),
    ("swap is an object", "nvme", setter(lambda p: first(p, "adamw_update")["attrs"].update(swap={"a": 1})), "attrs.swap: expected an array"),
    ("swap from a host buffer", "nvme", setter(lambda p: first(p, "adamw_update")["attrs"]["swap"][0].__setitem__(0, first(p, "adamw_update")["in"][0])), "is no buffer in the swap file"),
    ("swap staging of other bytes (the lr copy)", "nvme", setter(lambda p: first(p, "adamw_update")["attrs"]["swap"][0].__setitem__(1, first(p, "adamw_update")["in"][4])), "must be a transient host buffer of the file buffer's"),
    ("swap staging not written back", "nvme", setter(lambda p: first(p, "adamw_update")["out"].__setitem__(1, first(p, "adamw_update")["in"][0])), "does not write its staging buffer"),
    # offload-nvme's read ahead: after an earlier instruction, the staging live from there
    ("swap_read_at at its own instruction", "nvme", setter(lambda p: first(p, "adamw_update")["attrs"].update(swap_read_at=p["program"].index(first(p, "adamw_update")))), "a read ahead is issued after an earlier instruction"),
    ("swap_read_at -1", "nvme", setter(lambda p: first(p, "adamw_update")["attrs"].update(swap_read_at=-1)), "swap_read_at: expected an integer in [0,"),
    ("swap_read_at before its staging is live", "nvme", setter(lambda p: p["buffers"][first(p, "adamw_update")["attrs"]["swap"][0][1]].update(first=p["program"].index(first(p, "adamw_update")))), "starts later: another buffer could take its bytes while it is read"),
    ("swap_read_at without swap", "nvme", setter(lambda p: first(p, "matmul")["attrs"].update(swap_read_at=0)), "has \"swap_read_at\" but no \"swap\""),
    # offload-nvme-params: the units' storage in the swap file too, each copy
    # to the device reading the blocks of a view of it ([Note: parameters on disk])
    ("a copy's swap written back", "nvmep", setter(lambda p: first(p, "to_device")["attrs"]["swap"][0].__setitem__(2, True)), "a copy to the device writes nothing back"),
    ("a copy's swap off a block", "nvmep", setter(lambda p: first(p, "to_device")["attrs"]["swap"][0].__setitem__(3, 64)), "not whole blocks of the swap_alignment 4096"),
    ("a copy's swap past its buffer", "nvmep", setter(lambda p: first(p, "to_device")["attrs"]["swap"][0].__setitem__(3, 1 << 20)), "not whole blocks of the swap_alignment 4096 inside it"),
    ("a copy's swap offset -4096", "nvmep", setter(lambda p: first(p, "to_device")["attrs"]["swap"][0].__setitem__(3, -4096)), "not whole blocks"),
    ("a swap offset that is a string", "nvmep", setter(lambda p: first(p, "to_device")["attrs"]["swap"][0].__setitem__(3, "0")), "[file, staging, write, offset]"),
    ("a swap of five fields", "nvmep", setter(lambda p: first(p, "to_device")["attrs"]["swap"][0].append(0)), "[file, staging, write, offset]"),
    ("a copy reading its swap-file view", "nvmep", setter(lambda p: first(p, "to_device")["in"].__setitem__(0, next(b["id"] for b in p["buffers"] if b.get("space") == "nvme" and "alias_of" in b))), "which is in the swap file"),
    ("a copy not reading its staging", "nvmep", setter(lambda p: first(p, "to_device")["attrs"]["swap"][0].__setitem__(1, p["program"][1]["attrs"]["swap"][0][1])), "does not read its staging buffer"),
    ("a unit on disk not offloaded", "nvmep", setter(lambda p: p["units"][0].update(offloaded=False)), "is not offloaded but its storage is in the swap file"),
    ("a swap-file view of a host buffer", "nvmep", setter(lambda p: next(b for b in p["buffers"] if b.get("space") == "nvme" and "alias_of" in b).update(alias_of=next(b["id"] for b in p["buffers"] if b.get("space") == "host" and "alias_of" not in b))), "is a view in the swap file of buffer"),
    ("a partial swap on an update", "nvmep", setter(lambda p: first(p, "adamw_update")["attrs"]["swap"][0].append(4096)), "must be a transient host buffer of the file buffer's"),
    ("swap on a device matmul", "nvme", setter(lambda p: first(p, "matmul")["attrs"].update(swap=first(p, "adamw_update")["attrs"]["swap"])), "is no host instruction"),
    # fsdp-offload's next-step: carried waits join the previous step's update
    ("carried \"yes\"", "nextstep", setter(lambda p: p["program"][carried(p)[0]]["attrs"].update(carried="yes")), "\"carried\" is a boolean of a wait"),
    ("carried on a matmul", "nextstep", setter(lambda p: first(p, "matmul")["attrs"].update(carried=True)), "\"carried\" is a boolean of a wait"),
    ("a carried wait on no update's buffer", "nextstep", setter(lambda p: p["program"][carried(p)[0]].update({"in": [p["program"][carried(p)[1]]["out"][1]], "out": [p["program"][carried(p)[1]]["out"][1]]})), "joins no async host update issued later"),
    ("a carried wait after the first use", "nextstep", setter(carried_after_first_use), "joins the previous step's host update"),
    ("a carried update also joined in its step", "nextstep", setter(join_carried_in_its_step), "waits in its own step"),
    ("a carried update's gradient not live through the step", "nextstep", setter(carried_grad_live_from_its_copy), "must be live through the whole step"),
    # ... and with prefetch, on the copy stream: the copy after it waits, not compute
    ("copy_stream \"yes\"", "nextstep", setter(lambda p: p["program"][copy_stream_join(p)[0]]["attrs"].update(copy_stream="yes")), "\"copy_stream\" is a boolean of a carried wait"),
    ("copy_stream on a wait not carried", "nextstep", setter(lambda p: p["program"][copy_stream_join(p)[1]]["attrs"].update(copy_stream=True)), "\"copy_stream\" is a boolean of a carried wait"),
    ("a copy-stream join not followed by its copy", "nextstep", setter(copy_stream_copy_on_compute), "joins on the copy stream, but the next instruction is not an async to_device"),
    ("compute reads a copy-stream-joined unit before the copy's wait", "nextstep", setter(copy_stream_join_compute_read), "on compute after instruction"),
    ("an async copy's output read before its wait", "offload", setter(async_copy_read_before_wait), "which async instruction"),
    ("an async collective's input not live through its wait", "sharded", setter(async_input_freed_at_issue), "until its wait #"),
    ("a host update's wait dropped", "offload", setter(lambda p: next(i for i in p["program"] if i["op"] == "wait" and i["in"][0] == first(p, "adamw_update")["out"][0]).update(op="copy")), "without a wait"),
    ("unit storage bf16", "sharded", setter(lambda p: p["buffers"][p["units"][0]["buffer"]].update(dtype="bf16")), "shape x dtype needs"),
    ("trainable unit storage f16, sizes consistent", "sharded", setter(lambda p: p["buffers"][p["units"][0]["buffer"]].update(
        dtype="f16", shape=[p["buffers"][p["units"][0]["buffer"]]["shape"][0] * 2])), "a trainable unit stores f32 (its master copy) or bf16"),
    # collectives move one float dtype (bf16 in mixed-precision plans)
    ("reduce_scatter f32 -> bf16", "sharded", setter(lambda p: (lambda b: b.update(dtype="bf16", shape=[b["shape"][0] * 2]))(
        p["buffers"][first(p, "reduce_scatter")["out"][0]])), "expected one float dtype in and out"),
    ("reduce_scatter f32 -> i32", "sharded", setter(lambda p: p["buffers"][first(p, "reduce_scatter")["out"][0]].update(dtype="i32")),
     "expected one float dtype in and out"),
    ("unknown dtype", "mlp", setter(lambda p: p["buffers"][0].update(dtype="f8")), "unknown dtype"),
    ("lr buffer i32", "mlp", setter(lambda p: buf(p, next(b for b in p["inputs"] if b["role"] == "lr")).update(dtype="i32")), "f32 scalar"),
    # packing, inputs
    ("pack ranges overlap", "sharded", setter(lambda p: first(p, "pack")["attrs"]["offsets"].__setitem__(1, 0)), "overlap"),
    ("integer input range 0", "gpt", setter(lambda p: int_input(p).update(range=0)), "range >= 1"),
    ("integer input range missing", "gpt", setter(lambda p: int_input(p).pop("range")), "range >= 1"),
    ("input batch of 0", "mlp", setter(lambda p: buf(p, p["inputs"][0]).update(shape=[0, buf(p, p["inputs"][0])["shape"][1]], bytes=0)), "at least one element"),
    ("no loss output", "mlp", setter(lambda p: p.update(outputs=[])), "loss"),
    # a clipped plan returns one squared gradient norm without loss scaling
    ("two grad_sumsq outputs without loss scaling", "gpt", setter(lambda p: p["outputs"].append(
        next(b for b in p["outputs"] if b["role"] == "grad_sumsq"))), "found no policy, 0 and 2"),
    # the optimizer's step operand must hold the update count (the fuzzer
    # found a NaN there cast to an integer): wired to the lr buffer instead
    ("adamw step operand reads the lr", "mlp", setter(lambda p: first(p, "adamw_update")["in"].__setitem__(
        5, next(b for b in p["inputs"] if b["role"] == "lr")["buffer"])), "expected a whole update count >= 1"),
    ("adamw decay_numel -1", "mlp", setter(lambda p: first(p, "adamw_update")["attrs"].update(decay_numel=-1, shard_stride=0)),
     "decay_numel must be an integer in [0, 2^48]"),
    ("adamw shard_stride 5", "mlp", setter(lambda p: first(p, "adamw_update")["attrs"].update(decay_numel=4, shard_stride=5)),
     "shard_stride must be 0 (the whole unit) or the operand's"),
    # grad_scale (the clipping factor folded into the update): its operand
    # and its mark go together
    ("adamw grad_scale mark dropped", "gpt", setter(lambda p: first(p, "adamw_update")["attrs"].pop("grad_scale")),
     "operands, expected 6"),
    ("adamw grad_scale mark not a bool", "gpt", setter(lambda p: first(p, "adamw_update")["attrs"].update(grad_scale="yes")),
     "attribute grad_scale: expected true or false"),
    ("adamw skip_nonfinite marked, no operand", "gpt", setter(lambda p: first(p, "adamw_update")["attrs"].update(skip_nonfinite=True)),
     "operands, expected 8"),
    ("adamw grad_scale operand a vector", "gpt", setter(lambda p: first(p, "adamw_update")["in"].__setitem__(
        6, first(p, "adamw_update")["in"][1])), "expected a scalar grad_scale operand"),
    ("unknown op", "mlp", setter(lambda p: first(p, "relu").update(op="frobnicate")), "unknown op"),
    ("live buffers overlap", "mlp", setter(overlap_two), "overlap in memory while both are live"),
]


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


def safetensors(header, payload=b""):
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + payload


def gpu_present():
    """A CUDA GPU with a driver (as test/lit/lit.cfg.py's cuda-gpu feature)."""
    import shutil
    if not shutil.which("nvidia-smi"):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def main():
    bindir, mlp, gpt, sharded = sys.argv[1:5]
    llama = sys.argv[5] if len(sys.argv) > 5 else None
    offload = sys.argv[6] if len(sys.argv) > 6 else None
    unfused = sys.argv[7] if len(sys.argv) > 7 else None
    lamb = sys.argv[8] if len(sys.argv) > 8 else None
    nextstep = sys.argv[9] if len(sys.argv) > 9 else None
    nvme = sys.argv[10] if len(sys.argv) > 10 else None
    nvmep = sys.argv[11] if len(sys.argv) > 11 else None
    run_bin = os.path.join(bindir, "fsdp-run")
    plans = {}
    for key, path in (("mlp", mlp), ("gpt", gpt), ("sharded", sharded), ("llama", llama),
                      ("offload", offload), ("gpt_unfused", unfused), ("lamb", lamb),
                      ("nextstep", nextstep), ("nvme", nvme), ("nvmep", nvmep)):
        if path is None:
            continue
        with open(path) as f:
            plans[key] = json.load(f)
    failures = 0
    count = 0
    with tempfile.TemporaryDirectory() as tmp:
        def check(name, args, expect, env=None, stdin=None):
            nonlocal failures, count
            count += 1
            e = dict(os.environ)
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID",
                      "SLURM_NTASKS", "FSDP_RANK", "FSDP_WORLD_SIZE", "FSDP_STORE_DIR"):
                e.pop(k, None)
            e.update(env or {})
            try:
                r = subprocess.run([run_bin, "--threads", "1"] + args, env=e,
                                   capture_output=True, text=True, timeout=60)
                code, err = r.returncode, r.stderr
            except subprocess.TimeoutExpired:
                code, err = "timeout", ""
            ok = (code in (1, 2) and "fsdp-run: error" in err and expect in err)
            verdict = "ok" if ok else "FAIL"
            first_line = next((l for l in err.splitlines() if "error" in l), err.strip()[:120])
            if code not in (0, 1, 2, "timeout") and code < 0:
                code = f"signal {signal.Signals(-code).name}"
            print(f"{verdict:4} {name:<40} exit {code}: {first_line[:150]}")
            if not ok:
                failures += 1
                if expect not in err:
                    print(f"     expected the message to contain: {expect}")

        # --- plan files
        skipped = 0
        for name, key, mutate, expect in PLAN_CASES:
            if key not in plans:
                skipped += 1
                continue
            path = os.path.join(tmp, "bad.plan")
            with open(path, "w") as f:
                json.dump(mutate(plans[key]), f)
            check("plan: " + name, [path, "--steps", "1"], expect)
        deep = '{"format": "fsdp-plan", "version": 2, "options": ' + "[" * 200000 + "]" * 200000 + "}"
        check("plan: JSON nested 200000 deep", [write(os.path.join(tmp, "deep.plan"), deep.encode()), "--steps", "1"], "nested")
        check("plan: truncated", [write(os.path.join(tmp, "t.plan"), open(mlp, "rb").read()[:1000]), "--steps", "1"], "not valid JSON")
        check("plan: empty file", [write(os.path.join(tmp, "e.plan"), b""), "--steps", "1"], "not valid JSON")
        check("plan: binary garbage", [write(os.path.join(tmp, "g.plan"), bytes(range(256)) * 4), "--steps", "1"], "not valid JSON")
        check("plan: missing file", [os.path.join(tmp, "nope.plan")], "cannot open")
        check("plan: a directory", [tmp], "plan")
        check("plan: world size 1, run with 2 ranks", [mlp, "--steps", "1", "--nproc", "2"], "compiled for 1 rank")
        if nvme:
            check("nvme: no --nvme-dir", [nvme, "--steps", "1"], "give fsdp-run --nvme-dir")
            check("nvme: --nvme-dir missing", [nvme, "--steps", "1", "--nvme-dir", os.path.join(tmp, "none")], "is not a directory")
            check("nvme: --nvme-dir a file", [nvme, "--steps", "1", "--nvme-dir", mlp], "is not a directory")
            check("nvme: --nvme-io fast", [nvme, "--steps", "1", "--nvme-dir", tmp, "--nvme-io", "fast"], "--nvme-io: expected auto, direct or buffered")
            # A plan from before swap_alignment: direct I/O refused by name
            # (auto runs it buffered: offload_nvme.py (j)).
            old = json.load(open(nvme))
            old.pop("swap_alignment")
            check("nvme: --nvme-io direct, plan without swap_alignment", [write(os.path.join(tmp, "old-nvme.plan"), json.dumps(old).encode()), "--steps", "1", "--nvme-dir", tmp, "--nvme-io", "direct"], "no swap_alignment")

        # --- options
        check("option: unknown --frobnicate", [mlp, "--frobnicate"], "unknown option")
        check("option: unknown --frobnicate 3", [mlp, "--frobnicate", "3"], "unknown option")
        check("option: --seed 99999999999999999999", [mlp, "--seed", "99999999999999999999"], "--seed")
        check("option: --steps 0", [mlp, "--steps", "0"], "--steps")
        check("option: --steps abc", [mlp, "--steps", "abc"], "--steps")
        check("option: --lr nan", [mlp, "--lr", "nan"], "--lr")
        check("option: --lr 1e999", [mlp, "--lr", "1e999"], "--lr")
        check("option: --threads 0", [mlp, "--threads", "0"], "--threads")
        check("option: --steps without value", [mlp, "--steps"], "needs a value")
        check("option: --nproc 0", [mlp, "--nproc", "0"], "--nproc")
        check("option: --nproc 99999", [mlp, "--nproc", "99999"], "--nproc")
        check("option: --schedule exponential", [mlp, "--schedule", "exponential"],
              "--schedule must be constant, cosine, linear or wsd")
        check("option: --decay-steps 0", [mlp, "--schedule", "wsd", "--decay-steps", "0"],
              "--decay-steps")
        check("option: --decay-steps with cosine", [mlp, "--schedule", "cosine", "--decay-steps", "3"],
              "--decay-steps is wsd's")
        check("option: --decay-shape exp", [mlp, "--schedule", "wsd", "--decay-shape", "exp"],
              "--decay-shape must be linear, cosine or 1-sqrt, found 'exp'")
        check("option: --decay-shape with linear", [mlp, "--schedule", "linear", "--decay-shape", "cosine"],
              "--decay-shape is wsd's")
        check("option: wsd longer than the run",
              [mlp, "--schedule", "wsd", "--steps", "10", "--warmup", "5", "--decay-steps", "6"],
              "exceed --steps 10")
        check("option: --min-lr above --lr (linear)",
              [mlp, "--schedule", "linear", "--lr", "0.1", "--min-lr", "0.2"], "exceeds --lr")
        check("option: --device tpu", [mlp, "--device", "tpu"], "--device must be cpu or cuda")
        check("option: --comm tcp", [mlp, "--nproc", "2", "--comm", "tcp"],
              "--comm must be auto, shm, gloo or hybrid")
        check("option: --nnodes not dividing --nproc", [mlp, "--nproc", "4", "--nnodes", "3"],
              "--nnodes 3 does not divide --nproc 4")
        check("option: --cuda-graphs on the CPU device", [mlp, "--steps", "1", "--cuda-graphs"],
              "device cpu cannot capture a step")
        # No CUDA backend in this build or no GPU: one clear error, exit 1,
        # before any rank starts (where a GPU is, --device cuda just works).
        if not gpu_present():
            check("option: --device cuda", [mlp, "--steps", "1", "--device", "cuda"], "--device cpu")
            check("option: --device cuda --nproc 2", [mlp, "--steps", "1", "--device", "cuda", "--nproc", "2"], "--device cpu")
        check("option: --eval-every 0", [mlp, "--eval-every", "0"], "--eval-every")
        check("option: --eval-data without --eval-every", [mlp, "--eval-data", mlp], "need --eval-every")
        check("option: --eval-batches 0", [mlp, "--eval-every", "2", "--eval-batches", "0"], "--eval-batches")
        check("option: --eval-every on a token file without --eval-data",
              [gpt, "--data", mlp, "--eval-every", "2"], "name the held-out one with --eval-data")
        check("option: two plans", [mlp, gpt], "unexpected argument")
        check("option: no plan", ["--steps", "1"], "no plan")
        check("option: --save-every without --ckpt-dir", [mlp, "--save-every", "2"], "--ckpt-dir")
        check("option: --async-save without --ckpt-dir", [mlp, "--async-save"], "--ckpt-dir")
        check("option: --resume with --init-from", [mlp, "--resume", tmp, "--init-from", mlp], "pick one")
        check("option: --keep -1", [mlp, "--keep", "-1", "--ckpt-dir", tmp], "--keep")
        check("option: --trace-sync without --trace", [mlp, "--trace-sync"], "needs --trace FILE")

        # --- data files (llm.c token format)
        def tokens(magic=20240520, version=1, n=1000, body=None, count=None):
            header = [magic, version, n if count is None else count] + [0] * 253
            data = struct.pack("<256i", *header)
            return data + (body if body is not None else struct.pack(f"<{n}H", *([1] * n)))
        check("data: missing file", [gpt, "--steps", "1", "--data", os.path.join(tmp, "none.bin")], "none.bin")
        check("data: empty file", [gpt, "--steps", "1", "--data", write(os.path.join(tmp, "empty.bin"), b"")], "empty.bin")
        check("data: bad magic", [gpt, "--steps", "1", "--data", write(os.path.join(tmp, "magic.bin"), tokens(magic=7))], "magic")
        check("data: bad version", [gpt, "--steps", "1", "--data", write(os.path.join(tmp, "ver.bin"), tokens(version=9))], "version")
        check("data: count beyond the file", [gpt, "--steps", "1", "--data", write(os.path.join(tmp, "short.bin"), tokens(count=10 ** 6))], "short.bin")
        check("data: negative count", [gpt, "--steps", "1", "--data", write(os.path.join(tmp, "neg.bin"), tokens(count=-5, body=b""))], "neg.bin")
        check("data: too few tokens for a batch", [gpt, "--steps", "1", "--data", write(os.path.join(tmp, "few.bin"), tokens(n=3))], "few.bin")
        check("data: token id beyond the vocabulary", [gpt, "--steps", "1", "--data",
              write(os.path.join(tmp, "vocab.bin"), tokens(n=5000, body=struct.pack("<5000H", *([60000] * 5000))))], "vocabulary")
        check("data: --eval-data with too few tokens", [gpt, "--steps", "1", "--eval-every", "1", "--eval-data",
              os.path.join(tmp, "few.bin")], "few.bin")
        check("data: --eval-data token id beyond the vocabulary", [gpt, "--steps", "1", "--eval-every", "1",
              "--eval-data", os.path.join(tmp, "vocab.bin")], "vocabulary")
        check("data: --eval-data missing", [gpt, "--steps", "1", "--eval-every", "1", "--eval-data",
              os.path.join(tmp, "nope.bin")], "nope.bin")
        check("data: a token file for the MLP", [mlp, "--steps", "1", "--data", os.path.join(tmp, "vocab.bin")], "token")
        good = write(os.path.join(tmp, "good.bin"), tokens(n=5000))
        check("data: --loss-mask for a plan without ignore_index", [gpt, "--steps", "1", "--data", good,
              "--loss-mask", good], "needs a plan whose cross_entropy has ignore_index")
        check("data: --loss-mask of another length", [gpt, "--steps", "1", "--data", good, "--loss-mask",
              write(os.path.join(tmp, "mask.bin"), tokens(n=4999))], "4999 entries; the data file")
        check("data: --loss-mask missing", [gpt, "--steps", "1", "--data", good, "--loss-mask",
              os.path.join(tmp, "nomask.bin")], "nomask.bin")
        check("data: --loss-mask with synthetic data", [gpt, "--steps", "1", "--loss-mask", good],
              "it needs --data FILE")
        check("data: --eval-loss-mask without --eval-every", [gpt, "--steps", "1", "--data", good,
              "--eval-loss-mask", good], "need --eval-every")
        check("data: --eval-loss-mask for a plan without ignore_index", [gpt, "--steps", "1", "--data",
              good, "--eval-every", "1", "--eval-data", good, "--eval-loss-mask", good],
              "needs a plan whose cross_entropy has ignore_index")

        # --- checkpoints (--init-from)
        name = plans["mlp"]["params"][0]["name"]
        shape = plans["mlp"]["params"][0]["shape"]
        n = shape[0] * (shape[1] if len(shape) > 1 else 1)
        good = {name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * n]}}
        cases = [
            ("truncated header", b"\x10\x00\x00\x00\x00\x00\x00\x00{", "init"),
            ("header length 2^63", struct.pack("<Q", 2 ** 63) + b"{}", "header"),
            ("header not JSON", struct.pack("<Q", 4) + b"abcd", "header"),
            ("data_offsets past the end", safetensors(good), "init"),
            ("data_offsets INT64_MAX", safetensors({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, I64_MAX]}}), "init"),
            ("wrong shape", safetensors({name: {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}, b"\0" * 12), "shape"),
            ("dtype I64 for a float parameter", safetensors({name: {"dtype": "I64", "shape": shape, "data_offsets": [0, 8 * n]}}, b"\0" * (8 * n)), "dtype"),
            ("a tensor the model does not have", safetensors({"nonexistent.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "nonexistent.weight"),
            ("a parameter missing", safetensors({}), "has no tensor"),
            ("shape and bytes disagree", safetensors({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}, b"\0" * 4), "init"),
        ]
        for label, data, expect in cases:
            check("init-from: " + label, [mlp, "--steps", "1", "--init-from", write(os.path.join(tmp, "init.safetensors"), data)], expect)
        check("init-from: missing file", [mlp, "--steps", "1", "--init-from", os.path.join(tmp, "none.safetensors")], "none.safetensors")

        # --- Hugging Face sharded checkpoints (--init-from an index or a directory)
        def st_file(tensors):
            """safetensors bytes of {name: (dtype, shape, element size)}, zeros."""
            header, off = {}, 0
            for tname, (dtype, tshape, size) in tensors.items():
                nbytes = size
                for d in tshape:
                    nbytes *= d
                header[tname] = {"dtype": dtype, "shape": tshape, "data_offsets": [off, off + nbytes]}
                off += nbytes
            return safetensors(header, b"\0" * off)

        def hf_dir(label, shards, weight_map=None, index=True):
            """A checkpoint directory: shard files {file: {name: (dtype, shape, size)}}
            and an index (weight_map from the shards unless given)."""
            d = os.path.join(tmp, "hf-" + label.replace(" ", "-"))
            os.makedirs(d)
            wm = {}
            for fname, tensors in shards.items():
                write(os.path.join(d, fname), st_file(tensors))
                for tname in tensors:
                    wm.setdefault(tname, fname)
            if index:
                with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {"total_size": 0},
                               "weight_map": wm if weight_map is None else weight_map}, f)
            return d

        params = plans["mlp"]["params"]
        whole = {p["name"]: ("F32", p["shape"], 4) for p in params}
        half = len(params) // 2
        s1 = {p["name"]: whole[p["name"]] for p in params[:half]}
        s2 = {p["name"]: whole[p["name"]] for p in params[half:]}
        f1, f2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        p0, plast = params[0]["name"], params[-1]["name"]
        ok_dir = hf_dir("valid", {f1: s1, f2: s2})
        os.remove(os.path.join(ok_dir, f2))
        hf_cases = [
            ("missing shard file", ok_dir, f2),
            ("index weight_map is a list",
             hf_dir("wm list", {f1: s1, f2: s2}, weight_map=[f1, f2]), "weight_map: expected an object"),
            ("index weight_map value is a number",
             hf_dir("wm number", {f1: s1, f2: s2}, weight_map={p0: 1}), "weight_map['" + p0 + "']"),
            ("tensor missing from its shard",
             hf_dir("missing", {f1: {k: v for k, v in s1.items() if k != p0}, f2: s2},
                    weight_map={**{k: f1 for k in s1}, **{k: f2 for k in s2}}),
             "which has no tensor '" + p0 + "'"),
            ("tensor in two shards",
             hf_dir("twice", {f1: s1, f2: {**s2, p0: s1[p0]}}), "'" + p0 + "' is in two shards"),
            ("I32 tensor in a shard",
             hf_dir("int", {f1: s1, f2: {**s2, plast: ("I32", whole[plast][1], 4)}}),
             "'" + plast + "' has dtype I32"),
            ("shape mismatch in a shard",
             hf_dir("shape", {f1: s1, f2: {**s2, plast: ("BF16", [3, 5], 2)}}), "has shape [3, 5]"),
            ("directory with neither file", hf_dir("neither", {f1: s1, f2: s2}, index=False),
             "nor 'model.safetensors'"),
        ]
        for label, path, expect in hf_cases:
            check("init-from: " + label, [mlp, "--steps", "1", "--init-from", path], expect)
        # The same refusal on every rank of a job: one error, exit 1, no hang.
        check("init-from: missing shard file, 2 ranks", [sharded, "--steps", "1", "--nproc", "2",
              "--init-from", os.path.join(ok_dir, "model.safetensors.index.json")], f2)

        # --- outputs: never replace something that is not a regular file
        fifo = os.path.join(tmp, "fifo")
        os.mkfifo(fifo)
        check("save: onto a FIFO", [mlp, "--steps", "1", "--save", fifo], "regular file")
        if not os.path.exists(fifo) or not __import__("stat").S_ISFIFO(os.stat(fifo).st_mode):
            print("FAIL save: the FIFO was replaced")
            failures += 1
        check("save: into a missing directory", [mlp, "--steps", "1", "--save", os.path.join(tmp, "no", "x.safetensors")], "x.safetensors")
        check("save: onto a directory", [mlp, "--steps", "1", "--save", tmp], "regular file")

        # --- environment
        check("env: RANK without WORLD_SIZE", [mlp, "--steps", "1"], "WORLD_SIZE", env={"RANK": "0"})
        check("env: WORLD_SIZE=abc", [mlp, "--steps", "1"], "WORLD_SIZE", env={"RANK": "0", "WORLD_SIZE": "abc"})
        check("env: RANK >= WORLD_SIZE", [mlp, "--steps", "1"], "RANK", env={"RANK": "3", "WORLD_SIZE": "2"})
        check("env: RANK=-1", [mlp, "--steps", "1"], "RANK", env={"RANK": "-1", "WORLD_SIZE": "2"})

    print(f"{count} bad inputs, {count - failures} rejected cleanly"
          + (f" ({skipped} plan cases skipped: an optional plan not given)" if skipped else ""))
    print("all bad inputs rejected cleanly" if not failures else f"FAIL: {failures} case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
