#!/usr/bin/python3
"""The PyTorch oracle: replays an fsdp-run training run in PyTorch.

fsdp-run PLAN --dump-dir DIR writes the initial parameters, the parameters
after every step, every batch, the learning rate of every step and the
losses it computed. This script builds the same model in PyTorch (the
structures of examples/gen_models.py, with the same parameter names) and
makes two comparisons (test/oracle/README.md explains why these two):

every step is re-run in float64 from *our* parameters before the step
(teacher forcing), so a rounding difference is checked where it arises
instead of after compounding for 20 steps:
1. losses: our loss at every step equals PyTorch's float64 loss at the
   same parameters within --rtol (relative);
2. updates: our parameters after every step equal the float64 optimizer
   update (torch's AdamW / SGD formulas, state accumulated along our
   trajectory), element by element, within a bound derived from the update
   rule and float32 rounding.
A plan with quantized weight all-gathers (weight-quantization=int8) is
replayed with each step's loss and gradients taken at the parameters
dequantized per rank's shard (dequantized()), the update applied to the
exact ones. A plan with quantized gradient reduce-scatters
(gradient-quantization=int8) is replayed with every rank's gradients on
its own rows, reduced as the all-to-all and its owner's sum do
(quantized_reduce()), within a bound that adds one quantum where a value
lies within our gradient's rounding of a tie.
A free-running float32 PyTorch run (torch.optim) is printed beside, for
information (without the quantization).

  torch_ref.py --model mlp|gpt|llama [size options] --plan PLAN --dump-dir DIR
               [--rtol 1e-5] [--batches-dir DIR]

Exits 0 when both hold, 1 otherwise. Run it with Debian's /usr/bin/python3
(torch 1.13).
"""
import argparse
import json
import math
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "I32": torch.int32, "I64": torch.int64,
          "F16": torch.float16, "BF16": torch.bfloat16}

# fsdp.dropout's mask (runtime/core/Dropout.h), rebuilt here so the PyTorch
# model drops exactly the elements fsdp-run drops: p, the run's seed and
# the step being replayed (set by the loops below); one rank, no
# micro-batches, so an element's global index is its flat index.
DROPOUT = {"p": 0.0, "seed": 1234, "step": 0}
# The cross-entropy's label smoothing (gen_models.py gpt --label-smoothing),
# given here rather than read from the plan, so a compiler that dropped
# the attribute fails the comparison.
LABEL_SMOOTHING = {"e": 0.0}
# The cross-entropy's ignore_index (gen_models.py gpt --ignore-index,
# fsdp-run --loss-mask), given here too. None: no label is ignored (a
# label out of range is an error, as in fsdp-run). "blocks" = K > 1 is a
# deliberately wrong normalization for the tests' negative control: the
# mean over K equal row blocks of each block's kept mean (what a per-rank
# or per-micro-batch mean gives), not PyTorch's mean over the batch.
IGNORE = {"index": None, "blocks": 1}
M64 = (1 << 64) - 1


def _mix(z):
    """splitmix64's finalizer on uint64 (numpy arrays wrap; ints masked)."""
    import numpy as np
    if isinstance(z, int):
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
        return z ^ (z >> 31)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def dropout_mask(shape, op_id):
    """The keep mask (bool tensor) of dropout `op_id` at DROPOUT's step."""
    import numpy as np
    s = _mix(DROPOUT["seed"] ^ _mix((0xD20F + DROPOUT["step"]) & M64))
    key = _mix((s + (op_id + 1) * 0xBF58476D1CE4E5B9) & M64)
    n = math.prod(shape)
    g = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(np.uint64(key) + g * np.uint64(0x9E3779B97F4A7C15))
    keep = (h >> np.uint64(40)).astype(np.int64) >= round(DROPOUT["p"] * 16777216)
    return torch.from_numpy(keep.reshape(shape))


def drop(x, op_id):
    """nn.Dropout(p) in training mode with fsdp.dropout's mask."""
    if DROPOUT["p"] <= 0:
        return x
    scale = torch.tensor(1.0 / (1.0 - DROPOUT["p"]), dtype=torch.float32).to(x.dtype)
    return torch.where(dropout_mask(tuple(x.shape), op_id), x * scale, torch.zeros_like(x))


def read_safetensors(path):
    """A minimal safetensors reader (the safetensors package is not in Debian)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        t = torch.frombuffer(bytearray(data[base + lo:base + hi]),
                             dtype=DTYPES[meta["dtype"]])
        out[name] = t.reshape(meta["shape"]).clone()
    return out


class MLP(nn.Module):
    """The FSDP2 tutorial MLP (examples/gen_models.py mlp)."""

    def __init__(self, hidden, blocks):
        super().__init__()

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.in_proj = nn.Linear(hidden, hidden)
                self.out_proj = nn.Linear(hidden, hidden)

        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(hidden, 1)

    def loss(self, x, y):
        for i, b in enumerate(self.layers):
            x = b.out_proj(drop(F.relu(b.in_proj(x)), i))
        return F.binary_cross_entropy_with_logits(self.head(x), y)


class GPT(nn.Module):
    """GPT-2 style, pre-LN, tied LM head (examples/gen_models.py gpt)."""

    def __init__(self, vocab, ctx, layers, heads, width):
        super().__init__()
        self.heads = heads
        C = width

        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_attn = nn.Linear(C, 3 * C)
                self.c_proj = nn.Linear(C, C)

        class Mlp(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_fc = nn.Linear(C, 4 * C)
                self.c_proj = nn.Linear(4 * C, C)

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln_1 = nn.LayerNorm(C)
                self.attn = Attn()
                self.ln_2 = nn.LayerNorm(C)
                self.mlp = Mlp()

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, C), wpe=nn.Embedding(ctx, C),
            h=nn.ModuleList(Block() for _ in range(layers)), ln_f=nn.LayerNorm(C)))

    def attention(self, x, attn):
        B, T, C = x.shape
        H, D = self.heads, C // self.heads
        q, k, v = attn.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return attn.c_proj(y)

    def loss(self, ids, targets):
        tr = self.transformer
        x = drop(tr.wte(ids.long()) + tr.wpe.weight, 0)
        for i, b in enumerate(tr.h):
            x = x + drop(self.attention(b.ln_1(x), b.attn), 1 + 2 * i)
            x = x + drop(b.mlp.c_proj(F.gelu(b.mlp.c_fc(b.ln_2(x)), approximate="tanh")),
                         2 + 2 * i)
        logits = tr.ln_f(x) @ tr.wte.weight.t()
        return cross_entropy(logits, targets)


class Llama(nn.Module):
    """Llama-style decoder (examples/gen_models.py llama), written as HF
    transformers' LlamaForCausalLM computes it: RMSNorm, rotate-half rotary
    embedding, grouped-query causal attention (repeat_kv), SwiGLU MLP,
    untied LM head, no biases. torch 1.13 has no nn.RMSNorm: spelled out."""

    def __init__(self, vocab, ctx, layers, heads, kv_heads, width, ffn, theta, eps):
        super().__init__()
        self.heads, self.kv_heads, self.theta, self.eps = heads, kv_heads, theta, eps
        C, D = width, width // heads

        class RMSNorm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(C))

        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.q_proj = nn.Linear(C, heads * D, bias=False)
                self.k_proj = nn.Linear(C, kv_heads * D, bias=False)
                self.v_proj = nn.Linear(C, kv_heads * D, bias=False)
                self.o_proj = nn.Linear(heads * D, C, bias=False)

        class Mlp(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate_proj = nn.Linear(C, ffn, bias=False)
                self.up_proj = nn.Linear(C, ffn, bias=False)
                self.down_proj = nn.Linear(ffn, C, bias=False)

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.input_layernorm = RMSNorm()
                self.self_attn = Attn()
                self.post_attention_layernorm = RMSNorm()
                self.mlp = Mlp()

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed_tokens = nn.Embedding(vocab, C)
                self.layers = nn.ModuleList(Layer() for _ in range(layers))
                self.norm = RMSNorm()

        self.model = Model()
        self.lm_head = nn.Linear(C, vocab, bias=False)

    def rms_norm(self, x, norm):
        # LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), times the weight.
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x):
        """HF apply_rotary_pos_emb on x [B, H, T, D]: x cos + rotate_half(x) sin,
        angles t * theta^(-2i/D) (computed in float64 here)."""
        T, D = x.shape[2], x.shape[3]
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def attention(self, x, attn):
        B, T, C = x.shape
        H, G = self.heads, self.kv_heads
        D = C // H
        q = attn.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, G, D).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, G, D).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        # repeat_kv: key/value head j serves query heads j*H/G .. (j+1)*H/G - 1
        k = k[:, :, None].expand(B, G, H // G, T, D).reshape(B, H, T, D)
        v = v[:, :, None].expand(B, G, H // G, T, D).reshape(B, H, T, D)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return attn.o_proj(y)

    def loss(self, ids, targets):
        m = self.model
        x = m.embed_tokens(ids.long())
        for layer in m.layers:
            x = x + self.attention(self.rms_norm(x, layer.input_layernorm), layer.self_attn)
            h = self.rms_norm(x, layer.post_attention_layernorm)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        logits = self.lm_head(self.rms_norm(x, m.norm))
        return cross_entropy(logits, targets)


def cross_entropy(logits, targets):
    """F.cross_entropy over all positions with the options above."""
    x, y = logits.view(-1, logits.size(-1)), targets.long().view(-1)
    kw = {"label_smoothing": LABEL_SMOOTHING["e"]}
    if IGNORE["index"] is None:
        return F.cross_entropy(x, y, ignore_index=-(1 << 62), **kw)  # nothing ignored
    k = IGNORE["blocks"]
    if k == 1:
        return F.cross_entropy(x, y, ignore_index=IGNORE["index"], **kw)
    return sum(F.cross_entropy(xb, yb, ignore_index=IGNORE["index"], **kw)
               for xb, yb in zip(x.chunk(k), y.chunk(k))) / k


def load_script(path):
    """A model script of fsdp-import (tools/fsdp-import): model() returns the
    nn.Module whose forward(x, y) is the loss."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fsdp_import_user_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(args):
    if getattr(args, "script", None):  # bf16_ref.py's arguments have none
        model = load_script(args.script).model()
        model.loss = model.forward  # the imported model's loss is its forward
        return model
    if args.model == "mlp":
        return MLP(args.hidden, args.blocks)
    if args.model == "llama":
        return Llama(args.vocab, args.ctx, args.layers, args.heads, args.kv_heads,
                     args.width, args.ffn, args.rope_theta, args.norm_eps)
    return GPT(args.vocab, args.ctx, args.layers, args.heads, args.width)


def load_init(model, init):
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(init))
    extra = sorted(set(init) - set(params))
    if missing or extra:
        sys.exit(f"parameter names differ: missing in the dump {missing}, "
                 f"unknown to the torch model {extra}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(init[name].shape) != tuple(p.shape):
                sys.exit(f"{name}: shape {tuple(init[name].shape)} in the dump, "
                         f"{tuple(p.shape)} in the torch model")
            p.copy_(init[name])


def decay_of(opts, p):
    """The weight decay of parameter p: weight-decay-params=matrices decays
    only tensors of rank >= 2 (nanoGPT's configure_optimizers groups)."""
    if opts.get("weight_decay_params", "all") == "matrices" and p.dim() < 2:
        return 0.0
    return opts["weight_decay"]


class Lamb(torch.optim.Optimizer):
    """timm's Lamb (apex FusedLAMB's default: grad averaging, bias
    correction, the trust ratio only where weight decay applies, no trust
    clip, no clipping of its own), for the free-running comparison: torch
    ships no LAMB. The same arithmetic, in the same order, as fsdp.lamb_update."""

    def __init__(self, params, lr, betas, eps, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            wd = group["weight_decay"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["step"] += 1
                t = st["step"]
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["v"].sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
                u = (st["m"] / (1 - b1 ** t)).div_(denom)
                if wd != 0:
                    u.add_(p, alpha=wd)
                    pn, un = p.norm(2.0), u.norm(2.0)
                    if pn > 0 and un > 0:
                        u.mul_(pn / un)
                p.add_(u, alpha=-group["lr"])


def make_optimizer(model, opts, lr):
    kind = opts.get("optimizer", "adamw")
    groups = {}
    for p in model.parameters():
        groups.setdefault(decay_of(opts, p), []).append(p)
    groups = [{"params": ps, "weight_decay": wd} for wd, ps in groups.items()]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr,
                                 betas=(opts["beta1"], opts["beta2"]), eps=opts["eps"])
    if kind == "lamb":
        return Lamb(groups, lr=lr, betas=(opts["beta1"], opts["beta2"]), eps=opts["eps"])
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=opts["momentum"],
                               dampening=opts["dampening"],
                               nesterov=bool(opts["nesterov"]))
    sys.exit(f"unsupported optimizer '{kind}'")


U32 = 2.0 ** -24  # float32 unit roundoff


def eight_bit_ratios(pending, unit_of):
    """The worst |ours - float64's| / allowed of 8-bit moments (Moments8.h),
    per kind, over one step's parameters. Ours is float32's new moment
    (float64's within `err`) encoded to the nearest code of its block and
    decoded: a code of k mantissa bits relative to the block's scale
    S = (its largest magnitude) / kMax is within half a step, 2^-(k+1) of
    its binade (normal codes) or 2^(-7-k) S (subnormal), plus a few float32
    roundings (the reciprocal, the product, the decode: 8 u). exp_avg_sq is
    stored as its root r (k = 4) and decoded as the root squared: within
    2 r d + d^2 + u v of float32's, d the root's bound. S is bounded by the
    unit's largest magnitude (a block lies in one unit): valid, and loose
    only for the subnormal codes."""
    unit_max = {}
    for n, kind, want, mine, err in pending:
        key = (unit_of.get(n, n), kind)
        top = torch.maximum(want.abs(), mine.abs()).max().item()
        if kind == "exp_avg_sq":
            top = math.sqrt(top)
        unit_max[key] = max(unit_max.get(key, 0.0), top)
    worst = {}
    for n, kind, want, mine, err in pending:
        root = kind == "exp_avg_sq"
        k, kmax = (4, 496.0) if root else (3, 480.0)
        scale = unit_max[(unit_of.get(n, n), kind)] * (1 + 2.0 ** -k) / kmax
        if root:
            r = torch.sqrt(want.abs() + err)
            d = 2.0 ** -(k + 1) * r + 2.0 ** (-7 - k) * scale + 8 * U32 * r
            bound = 2 * r * d + d * d + U32 * mine.abs() + err
        else:
            mag = torch.maximum(want.abs(), mine.abs())
            bound = (2.0 ** -(k + 1) * mag + 2.0 ** (-7 - k) * scale + 8 * U32 * mag + err)
        r = ((mine - want).abs() / (bound + 1e-45)).max().item()
        worst[kind] = max(worst.get(kind, 0.0), r)
    return worst


# 4-bit moments (runtime/core/Moments4.h): exp_avg's signed map (its
# magnitudes; the negative side has no -1, so a negative value above
# 0.8875 of its block's largest rounds down to it) and exp_avg_sq's roots'
# levels 2^(-(15 - c) / 2), without zero (a root below the first reads as
# it), each as float32 holds it.
def _f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


M4_MAGS = [_f32(x) for x in (0.0, 0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0)]
ROOT4 = [_f32(2.0 ** (-(15 - c) / 2)) for c in range(16)]


def _worst_errors(levels, floor):
    """(lo, hi, w): on [lo, hi] of |x| / a the code's error is at most w a
    (half the gap between neighbours; with `floor`, below the first level
    a value reads as it)."""
    out = [(0.0, levels[0], levels[0])] if floor else []
    out += [(a, b, (b - a) / 2) for a, b in zip(levels, levels[1:])]
    return out


def four_bit_ratios(pending, unit_of):
    """The worst |ours - float64's| / allowed of 4-bit moments, per kind,
    over one step's parameters. Ours is float32's new moment x (float64's
    within `err`) coded as the level nearest x / a, a its block's largest
    magnitude (the scale), and decoded as level x a. A block's a is not in
    the dump, only bounded: |x| <= a <= U, U the unit's largest (a block
    lies in one unit). On the interval [lo, hi] of |x| / a the error is at
    most w a (w half the gap there), so over every a the error is at most
    the largest w min(U, |x| / lo) over the intervals some a in [|x|, U]
    reaches. Plus float32's roundings (the reciprocal, the product, the
    decode: 8 u). exp_avg_sq is stored as its root r and decoded as the
    root squared: within 2 r d + d^2 + u v, d the root's bound."""
    unit_max = {}
    for n, kind, want, mine, err in pending:
        key = (unit_of.get(n, n), kind)
        top = (torch.maximum(want.abs(), mine.abs()) + err).max().item()
        if kind == "exp_avg_sq":
            top = math.sqrt(top)
        unit_max[key] = max(unit_max.get(key, 0.0), top * (1 + 2.0 ** -20))
    worst = {}
    for n, kind, want, mine, err in pending:
        root = kind == "exp_avg_sq"
        big = unit_max[(unit_of.get(n, n), kind)]
        if root:
            hi_x = torch.sqrt(want.abs() + err)
            lo_x = torch.sqrt((want.abs() - err).clamp(min=0))
            spans = [(_worst_errors(ROOT4, True), torch.ones_like(want, dtype=torch.bool))]
        else:
            hi_x, lo_x = want.abs() + err, (want.abs() - err).clamp(min=0)
            neg = want < 0
            pos_spans = _worst_errors(M4_MAGS, False)
            # negative: [0.8875, 1] reads as -0.8875 (no -1 level)
            neg_spans = pos_spans[:-1] + [(M4_MAGS[-2], 1.0, 1.0 - M4_MAGS[-2])]
            spans = [(pos_spans, ~neg), (neg_spans, neg)]
        d = torch.zeros_like(want)
        for intervals, mask in spans:
            for lo, hi, w in intervals:
                a_min = torch.maximum(lo_x / hi, lo_x)
                a_top = (hi_x / lo).clamp(max=big) if lo > 0 else torch.full_like(hi_x, big)
                reach = mask & (a_min <= big) & (a_top >= a_min)
                d = torch.where(reach, torch.maximum(d, w * a_top), d)
        d = d + 8 * U32 * hi_x
        if root:
            bound = 2 * hi_x * d + d * d + U32 * mine.abs() + err
        else:
            bound = d + err
        r = ((mine - want).abs() / (bound + 1e-45)).max().item()
        worst[kind] = max(worst.get(kind, 0.0), r)
    return worst


def rounding_depth(args):
    """n in the worst-case float32 error bound |dg| <= n u max|g| of a gradient.

    A dot product of length K carries at most K u of relative rounding
    (gamma_K) and a gradient passes through L such products on its longest
    forward + backward path, so n = K L with K the longest contraction of
    the model and L that path length. Intermediate magnitudes are taken to
    be of the order of the largest gradient element (a bound for these
    small, well-scaled models, not for any network).
    """
    if args.model == "mlp":
        rows = args.batch
        K = max(args.hidden, rows)
        L = 2 * (2 * args.blocks + 1)
    elif args.model == "llama":
        rows = args.batch * args.ctx
        K = max(args.ffn, args.width, rows, args.vocab, args.ctx)
        # per layer: q/k/v, rope, q k^T, att v, o, gate/up, silu * up, down
        # (+2 RMS norms); then the final norm and the head
        L = 2 * (10 * args.layers + 2)
    else:
        rows = args.batch * args.ctx
        K = max(4 * args.width, rows, args.vocab, args.ctx)
        # per layer: qkv, q k^T, att v, proj, fc, fc2 (+2 layer norms), head
        L = 2 * (8 * args.layers + 2)
    return K * L


class UpdateCheck:
    """Teacher-forced float64 replay of one optimizer, with per-element bounds.

    For AdamW the update direction u = mhat / (sqrt(vhat) + eps) is a ratio
    of a convex combination of past gradients and a weighted L2 norm of
    them, so a gradient error of at most D per element moves mhat and
    sqrt(vhat) by at most D each, and u by at most
        E = D (1 + |u|) / (max(sqrt(vhat) - D, 0) + eps).
    Whatever the gradients, |u| <= R_t (Cauchy-Schwarz on the two sums), so
    two implementations never differ by more than 2 R_t: elements whose
    gradient is at the rounding level get that bound, the others the
    tighter E. For SGD the buffer is linear in the gradients: an error D_t
    at step t adds (1 - dampening) mu^k D_t to the buffer k steps later.
    On top: the float32 rounding of the update arithmetic itself.

    LAMB moves by lr r u, u = AdamW's direction + wd theta (theta is ours,
    exact), r = ||theta|| / ||u|| (where weight decay applies). u carries
    AdamW's per-element bound E, so ||u|| is off by at most ||E||_2 = dU
    (triangle inequality) and r by at most r dU / (||u|| - dU); the step
    by lr (dr (|u| + E) + r E). The norms' own rounding: each is a sum of
    squares accumulated in double, stored in f32 and summed over up to
    S = 64 shards in f32 (relative S u), halved by the square root: r
    within (S + 4) u, on top of the direction's f32 arithmetic.
    """

    def __init__(self, opts, params):
        self.o = opts
        self.kind = opts.get("optimizer", "adamw")
        self.state = {n: {} for n in params}
        self.t = 0

    def ratio_bound(self, t):
        b1, b2 = self.o["beta1"], self.o["beta2"]
        s = sum((b1 * b1 / b2) ** k for k in range(t))
        return (1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2)) * math.sqrt(s)

    def step(self, name, theta, g, D, lr, moments=None):
        """Returns (expected theta after the step, allowed |difference|).
        moments: our AdamW moments (or SGD momentum buffer) before the
        step (bf16 state: the update reads them, not a float64 running
        sum); the new ones this step expects are left in self.state[name]
        as m, v (buf)."""
        o, st, t = self.o, self.state[name], self.t
        wd = decay_of(o, theta)
        if self.kind in ("adamw", "lamb"):
            b1, b2, eps = o["beta1"], o["beta2"], o["eps"]
            if not st:
                st.update(m=torch.zeros_like(g), v=torch.zeros_like(g),
                          D=torch.zeros_like(g))
            if moments is not None:
                st["m"], st["v"] = moments
            st["m"] = b1 * st["m"] + (1 - b1) * g
            st["v"] = b2 * st["v"] + (1 - b2) * g * g
            st["D"] = torch.maximum(st["D"], D)
            Dm = st["D"]
            mhat = st["m"] / (1 - b1 ** t)
            s = (st["v"] / (1 - b2 ** t)).sqrt()
            u = mhat / (s + eps)
            E = Dm * (1 + u.abs()) / ((s - Dm).clamp(min=0) + eps)
            E = torch.minimum(E, torch.full_like(E, 2 * self.ratio_bound(t)))
            if self.kind == "lamb":
                u = u + wd * theta
                r, dr = 1.0, 0.0
                pn, un, dU = theta.norm().item(), u.norm().item(), E.norm().item()
                if wd != 0 and pn > 0 and un > 0:
                    r = pn / un
                    dr = r * dU / (un - dU) if un > dU else math.inf
                expected = theta - lr * r * u
                allowed = lr * (dr * (u.abs() + E) + r * E)
                arith = (lr * r * (2 * t + 8 + 64 + 4) * U32 * u.abs()
                         + 4 * U32 * theta.abs())
                return expected, allowed + arith
            expected = theta * (1 - lr * wd) - lr * u
            allowed = lr * E
            arith = lr * (2 * t + 6) * U32 * u.abs() + 4 * U32 * theta.abs()
            return expected, allowed + arith
        mu, damp, nesterov = o["momentum"], o["dampening"], bool(o["nesterov"])
        d = g + wd * theta
        if mu != 0:
            if not st:
                st.update(buf=d.clone(), Db=D.clone())
            elif moments is not None:
                # a bf16 buffer: the update reads ours (exact), so only
                # this step's gradient error enters it
                st["buf"] = mu * moments[0] + (1 - damp) * d
                st["Db"] = (1 - damp) * D
            else:
                st["buf"] = mu * st["buf"] + (1 - damp) * d
                st["Db"] = mu * st["Db"] + (1 - damp) * D
            d, Dd = ((d + mu * st["buf"], D + mu * st["Db"]) if nesterov
                     else (st["buf"], st["Db"]))
        else:
            Dd = D
        expected = theta - lr * d
        arith = lr * (2 * t + 4) * U32 * d.abs() + 4 * U32 * theta.abs()
        return expected, lr * Dd + arith


def quantization_block(plan):
    """The block of a plan whose all-gathers move int8 shards (fsdp-shard's
    weight-quantization=int8, ZeRO++'s qwZ), or None."""
    for i in (plan or {}).get("program", []):
        if i["op"] == "quantize" and "parts" not in i["attrs"]:
            return i["attrs"]["block"]
    return None


def gradient_quantization_block(plan):
    """The block of a plan whose gradient reduce-scatters are all-to-alls of
    int8 parts (gradient-quantization=int8, ZeRO++'s qgZ), or None."""
    for i in (plan or {}).get("program", []):
        if i["op"] == "quantize" and "parts" in i["attrs"]:
            return i["attrs"]["block"]
    return None


def quantize_f32(x, block):
    """x (float32, one part) quantized and dequantized in blocks as
    runtime/core/Quantize.h does, in float32: (values, per-value scale,
    per-value x x (127 / m))."""
    deq = torch.empty_like(x)
    scale = torch.empty_like(x)
    t = torch.zeros_like(x)
    for b in range(0, x.numel(), block):
        v = x[b:b + block]
        m = v.abs().max()
        s = m / 127.0
        scale[b:b + v.numel()] = s
        if not (torch.isfinite(m) and m > 0):
            deq[b:b + v.numel()] = v * 0.0 if m == 0 else float("nan")
            continue
        tv = v * (torch.tensor(127.0, dtype=torch.float32) / m)
        t[b:b + v.numel()] = tv
        deq[b:b + v.numel()] = torch.round(tv).clamp(-127.0, 127.0) * s
    return deq, scale, t


def quantized_mean(sources, ds, block):
    """fsdp.quantize of each of the parts `sources` (float32, one length)
    in blocks, and fsdp.dequantize's reduce = "mean" of them (the parts'
    dequantized values summed in order in float32, divided by their count:
    quant::dequantizeSumBlocks). `ds[k]`: how far (float64, per value) our
    part k may be from sources[k]. Returns (the mean, float32; how far ours
    may be from it, float64). Ours moves a block's largest magnitude m by at
    most the block's largest d (dm), so q x scale by at most dm, and
    x x (127 / m) by at most 127 (d + |t| dm / 127) / m: where that is
    closer to a tie (k + 1/2), q may round the other way, one quantum (the
    block's scale) more. Then the float32 sum's and the division's
    rounding."""
    W = len(sources)
    acc = err = mag = None
    for k, (f, d) in enumerate(zip(sources, ds)):
        deq, scale, t = quantize_f32(f, block)
        dm = torch.empty_like(d)
        for b in range(0, d.numel(), block):
            dm[b:b + block] = d[b:b + block].max()
        sc = scale.double()
        m = 127.0 * sc
        dt = 127.0 * (d + t.abs().double() * dm / 127.0) / m.clamp(min=1e-300)
        dt = dt + 4 * U32 * t.abs().double()
        near = (t.double() - torch.floor(t.double()) - 0.5).abs() <= dt
        e = dm + near.double() * sc
        acc = deq if k == 0 else acc + deq
        err = e if k == 0 else err + e
        mag = deq.abs().double() if k == 0 else mag + deq.abs().double()
    mean = acc / W
    return mean, err / W + (W - 1) * U32 * mag / W + U32 * mean.abs().double()


def quantized_reduce(per_rank, plan, block, deltas):
    """qgZ's reduce-scatter of the ranks' float64 gradients `per_rank`
    (dicts by name): each rank's unit gradients in float32, cut into the
    world's parts of S, each quantized in blocks, and part p's values
    averaged over the ranks in rank order (quantized_mean). Hierarchical
    (the plan's mesh "node" = L, M = G / L nodes): rank n L + i's part for
    place j of its node is its chunks j, j + L, ... (M S values, quantized
    as one part), averaged over the node's L ranks; place j's M S values
    cut into M parts of S, and chunk n L + j the mean of node n'
    place j's part n over the M nodes. Returns (expected gradients,
    per-element allowed difference): our gradient of rank r is within
    deltas[r] (and its float32 rounding) of the oracle's before the
    quantization."""
    W = len(per_rank)
    L = ((plan.get("mesh") or {}).get("node") or W)
    M = W // L
    out, allowed = {}, {}
    for ui, u in enumerate(plan["units"]):
        members = [p for p in plan["params"] if p["unit"] == ui]
        if not u["sharded"]:
            for p in members:
                g = sum(pr[p["name"]] for pr in per_rank) / W
                out[p["name"]] = g
                allowed[p["name"]] = torch.full_like(g, max(deltas))
            continue
        S, N = u["shard_numel"], u["padded_numel"]
        flats, ds = [], []
        for r, pr in enumerate(per_rank):
            flat = torch.zeros(N, dtype=torch.float64)
            for p in members:
                n = math.prod(p["shape"])
                flat[p["flat_offset"]:p["flat_offset"] + n] = pr[p["name"]].reshape(-1)
            f = flat.float()
            flats.append(f)
            ds.append(deltas[r] + U32 * f.abs().double())  # ours vs this float32 copy
        mean = torch.zeros(N, dtype=torch.float32)
        tol = torch.zeros(N, dtype=torch.float64)

        def chunks(v, j):  # chunks j, j + L, ... of S values
            return torch.cat([v[(n * L + j) * S:(n * L + j + 1) * S] for n in range(M)])

        for j in range(L):
            # Level 1 (the only one when L = W): each node's mean for place j.
            mids = [quantized_mean([chunks(flats[n * L + i], j) for i in range(L)],
                                   [chunks(ds[n * L + i], j) for i in range(L)], block)
                    for n in range(M)]
            for n0 in range(M):
                c = slice((n0 * L + j) * S, (n0 * L + j + 1) * S)
                if M == 1:
                    mean[c], tol[c] = mids[0][0], mids[0][1]
                    continue
                part = slice(n0 * S, (n0 + 1) * S)
                mean[c], tol[c] = quantized_mean([m[0][part] for m in mids],
                                                 [m[1][part] for m in mids], block)
        for p in members:
            n = math.prod(p["shape"])
            sl = slice(p["flat_offset"], p["flat_offset"] + n)
            out[p["name"]] = mean[sl].double().reshape(p["shape"])
            allowed[p["name"]] = tol[sl].reshape(p["shape"])
    return out, allowed


def dequantized(theta, plan, block):
    """The parameters a weight-quantized plan's step computes with: each
    sharded unit's flat parameters (float32, zero-padded), cut into its
    ranks' shards, each shard quantized in blocks of `block` as
    runtime/core/Quantize.h does (m = max |x|, values round-half-even(x x
    (127 / m)) clamped to [-127, 127], a block with a NaN or an infinity
    NaN) and dequantized (q x (m / 127)), all in float32. The same
    float32 operations in the same order: the same bits."""
    out = dict(theta)
    for ui, u in enumerate(plan["units"]):
        if not u["sharded"]:
            continue
        members = [p for p in plan["params"] if p["unit"] == ui]
        flat = torch.zeros(u["padded_numel"], dtype=torch.float32)
        for p in members:
            n = math.prod(p["shape"])
            flat[p["flat_offset"]:p["flat_offset"] + n] = theta[p["name"]].float().reshape(-1)
        S = u["shard_numel"]
        deq = torch.empty_like(flat)
        for lo in range(0, u["padded_numel"], S):
            for b in range(lo, lo + S, block):
                x = flat[b:min(b + block, lo + S)]
                m = x.abs().max()
                if not (torch.isfinite(m) and m > 0):
                    deq[b:b + x.numel()] = x * 0.0 if m == 0 else float("nan")
                    continue
                q = torch.round(x * (127.0 / m)).clamp(-127.0, 127.0)
                deq[b:b + x.numel()] = q * (m / 127.0)
        for p in members:
            n = math.prod(p["shape"])
            out[p["name"]] = deq[p["flat_offset"]:p["flat_offset"] + n].reshape(
                p["shape"]).to(theta[p["name"]].dtype)
    return out


def check_updates(args, opts, log, batches, inputs, targets, ours, init, plan=None):
    """Teacher forcing in float64: returns (ok, report lines)."""
    model = build(args).double()
    params = dict(model.named_parameters())
    check = UpdateCheck(opts, params)
    theta = {n: init[n].double() for n in params}
    n_round = rounding_depth(args)
    P = sum(p.numel() for p in params.values())
    worst = {n: 0.0 for n in params}  # max over steps of |diff| / allowed
    tight = {n: 0 for n in params}    # elements whose bound is below the generic one
    loss_worst = 0.0
    # Dynamic loss scaling (plans with "loss_scale"): GradScaler replayed
    # here from this oracle's own overflow decisions. A step overflows when
    # the squared norm of the scaled gradients is not a finite float32 (the
    # plan's test); its updates are skipped (our parameters must come back
    # unchanged, bit for bit) and the optimizer's step count is the applied
    # steps. A squared norm within 1e-3 of float32's largest value is
    # rounding-close to the boundary: either decision is accepted there.
    ls = (plan or {}).get("loss_scale")
    scale, tracker, applied = (ls["init"], 0, 0) if ls else (1.0, 0, 0)
    skipped_ours = set(log.get("skipped_steps", []))
    scaler_ok, skipped_seen = True, 0
    FLT_MAX = 3.4028234663852886e38
    # fsdp-run's gradient norm (log.json "grad_norms", plans that clip)
    # against clip_grad_norm_'s total norm in float64: apart by at most
    # sqrt(P) delta (each gradient element is within delta of float64's,
    # and | |a| - |b| | <= |a - b|) plus float32's sum of P squares
    # (relative P u at most, halved by the square root) and the root's
    # own rounding.
    norm_worst, norm_rel = None, 0.0
    # weight-quantization=int8: the step computes its loss and gradients at
    # the dequantized parameters; the update applies them to the exact
    # master (theta), as ZeRO++'s qwZ does.
    block = quantization_block(plan)
    # gradient-quantization=int8: the update applies each unit's gradients
    # reduced as qgZ does from every rank's own (its rows of the batch).
    gblock = gradient_quantization_block(plan)
    if gblock and (ls or opts.get("max_grad_norm", 0) > 0 or
                   (plan.get("mesh") or {}).get("replicas", 1) > 1):
        raise SystemExit("this oracle replays gradient-quantization=int8 without loss "
                         "scaling, clipping or a 2-D mesh")
    # optimizer-state-dtype=bf16: AdamW's moments are bf16 state, dumped
    # after every step; each update is replayed from ours and our new ones
    # checked against it (rounded once: one bf16 place stochastically,
    # half of one to nearest).
    # optimizer-state-dtype=8bit: AdamW's and LAMB's moments or SGD's
    # momentum buffer in 8-bit block codes (runtime/core/Moments8.h; the
    # buffer coded as exp_avg), dumped decoded; replayed as bf16 state is,
    # and our new ones checked within half a code step of float64's.
    # optimizer-state-dtype=4bit: AdamW's moments in 4-bit block codes
    # (runtime/core/Moments4.h), dumped decoded; replayed as 8-bit ones,
    # our new ones checked within half a level gap (four_bit_ratios).
    four_bit = opts.get("state_dtype") == "4bit"
    if four_bit and check.kind != "adamw":
        raise SystemExit("4-bit state is AdamW's moments (optimizer-state-dtype=4bit)")
    eight_bit = opts.get("state_dtype") in ("8bit", "4bit")
    if eight_bit and not (check.kind in ("adamw", "lamb")
                          or (check.kind == "sgd" and opts["momentum"] != 0)):
        raise SystemExit("8-bit state is AdamW's and LAMB's moments or SGD's momentum buffer "
                         "(optimizer-state-dtype=8bit)")
    unit_of = {p["name"]: p.get("unit", -1) for p in plan["params"]}
    bf16_moments = opts.get("state_dtype", "f32") in ("bf16", "8bit", "4bit")
    adam_like = check.kind in ("adamw", "lamb")
    if bf16_moments and not (adam_like or (check.kind == "sgd" and opts["momentum"] != 0)):
        raise SystemExit("bf16 state is AdamW's or LAMB's moments or SGD's momentum buffer "
                         "(optimizer-state-dtype=bf16)")
    rounding_places = 1.0 if opts.get("state_rounding") == "stochastic" else 0.5
    state_kinds = ["exp_avg", "exp_avg_sq"] if adam_like else ["momentum_buffer"]
    moment_worst = {k: 0.0 for k in state_kinds}
    prev = 0  # the last applied step (its moments start the next update)
    pending = []  # 8-bit moments: (param, kind, float64's, ours, f32 error bound)
    for step in range(1, log["steps"] + 1):
        lr = log["lr"][step - 1]
        used = dequantized(theta, plan, block) if block else theta
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(used[n])
        x = batches[f"step{step}.{inputs[0]}"]
        y = batches[f"step{step}.{targets[0]}"]
        if x.is_floating_point():
            x, y = x.double(), y.double()
        DROPOUT["step"] = step
        model.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        ours_loss = log["losses"][step - 1]
        loss_worst = max(loss_worst, abs(ours_loss - loss.item()) / abs(loss.item()))
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        qallowed = None
        if gblock:
            W = plan["world_size"]
            rows = x.shape[0] // W
            per_rank, deltas = [], []
            for r in range(W):
                model.zero_grad()
                model.loss(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]).backward()
                g_r = {n: p.grad.detach().clone() for n, p in params.items()}
                per_rank.append(g_r)
                deltas.append(n_round * U32 * max(g.abs().max().item() for g in g_r.values()))
            grads, qallowed = quantized_reduce(per_rank, plan, gblock, deltas)
        if ls:
            if log["loss_scales"][step - 1] != scale:
                scaler_ok = False
                print(f"  step {step}: our loss scale {log['loss_scales'][step - 1]:g}, "
                      f"GradScaler's {scale:g}")
            sumsq = sum((g * g).sum().item() for g in grads.values()) * scale * scale
            ours_skip = step in skipped_ours
            over = sumsq >= FLT_MAX or not math.isfinite(sumsq)
            if abs(sumsq - FLT_MAX) > 1e-3 * FLT_MAX and over != ours_skip:
                scaler_ok = False
                print(f"  step {step}: scaled squared norm {sumsq:.3e}: overflow "
                      f"{'expected' if over else 'not expected'}, ours "
                      f"{'skipped' if ours_skip else 'applied'} the update")
            if ours_skip:
                skipped_seen += 1
                scale, tracker = scale * ls["backoff_factor"], 0
                for n in params:
                    if not torch.equal(ours[f"step{step}.{n}"].double(), theta[n]):
                        scaler_ok = False
                        print(f"  step {step}: skipped, but {n} changed")
                continue
            tracker += 1
            if tracker == ls["growth_interval"]:
                scale, tracker = scale * ls["growth_factor"], 0
        applied += 1
        check.t = applied
        G = max(g.abs().max().item() for g in grads.values())
        delta = n_round * U32 * G
        clip = 1.0
        mgn = opts.get("max_grad_norm", 0)
        if mgn > 0:
            norm = math.sqrt(sum((g * g).sum().item() for g in grads.values()))
            clip = min(1.0, mgn / (norm + 1e-6))
            if not ls and "grad_norms" in log:
                allowed = math.sqrt(P) * delta + norm * (P * U32 / 2 + 2 * U32)
                ratio = abs(log["grad_norms"][step - 1] - norm) / allowed
                norm_worst = max(norm_worst or 0.0, ratio)
                norm_rel = max(norm_rel, abs(log["grad_norms"][step - 1] - norm) / norm)
            # our coefficient's relative error is at most |dg| / |g|
            dclip = clip * min(1.0, math.sqrt(P) * delta / max(norm, 1e-300)) if clip < 1 else 0.0
        for n in params:
            g = grads[n] * clip
            D = qallowed[n] if qallowed is not None else torch.full_like(g, clip * delta)
            if mgn > 0 and clip < 1:
                D = D + grads[n].abs() * dclip
            moments = None
            if bf16_moments:
                # The update starts from our stored moments (exact bf16
                # values); zero before the first applied step.
                moments = (tuple(ours[f"step{prev}.{n}.{k}"].double() for k in state_kinds)
                           if prev else tuple(torch.zeros_like(g) for _ in state_kinds))
                mv_prev = moments
            expected, allowed = check.step(n, theta[n], g, D, lr, moments)
            got = ours[f"step{step}.{n}"].double()
            ratio = ((got - expected).abs() / allowed).max().item()
            worst[n] = max(worst[n], ratio)
            if bf16_moments:
                # Our new moments: the float64 ones from the same start,
                # off by the gradient's error and float32's arithmetic,
                # then rounded once to bf16: within one bf16 place
                # (stochastic: the value below or above) or half of one
                # (to nearest).
                st = check.state[n]
                if adam_like:  # AdamW's and LAMB's moments: the same recurrences
                    b1, b2 = opts["beta1"], opts["beta2"]
                    new = (("exp_avg", st["m"], (1 - b1) * D
                            + 4 * U32 * (b1 * mv_prev[0].abs() + (1 - b1) * g.abs())),
                           ("exp_avg_sq", st["v"], (1 - b2) * (2 * g.abs() * D + D * D)
                            + 4 * U32 * (b2 * mv_prev[1] + (1 - b2) * g * g)))
                else:  # SGD: buf = mu buf + (1 - dampening) d, d = g + wd theta
                    mu = opts["momentum"]
                    d = g + decay_of(opts, theta[n]) * theta[n]
                    new = (("momentum_buffer", st["buf"], st["Db"]
                            + 4 * U32 * (mu * mv_prev[0].abs() + d.abs())),)
                for kind, want, err in new:
                    mine = ours[f"step{step}.{n}.{kind}"].double()
                    if eight_bit:  # judged once the step's every parameter is in
                        pending.append((n, kind, want, mine, err))
                        continue
                    mag = torch.maximum(want.abs(), mine.abs())
                    # bf16's spacing at mag: 2^(e - 7), at least its
                    # subnormals' 2^-133 (the f32 exponent range)
                    place = torch.exp2(torch.floor(torch.log2(mag.clamp(min=2.0 ** -126))) - 7)
                    bound = rounding_places * place + err + 1e-45
                    r = ((mine - want).abs() / bound).max().item()
                    moment_worst[kind] = max(moment_worst[kind], r)
            if check.kind in ("adamw", "lamb") and step == log["steps"]:
                generic = lr * 2 * check.ratio_bound(step)
                tight[n] = int((allowed < 0.5 * generic).sum().item())
            theta[n] = got
        if eight_bit:
            ratios = four_bit_ratios if four_bit else eight_bit_ratios
            for kind, r in ratios(pending, unit_of).items():
                moment_worst[kind] = max(moment_worst[kind], r)
            pending.clear()
        prev = step
    lines = [f"updates (float64, from our parameters before each step): "
             f"gradient rounding bound {n_round} u max|g|"]
    if block:
        lines.append(f"weight-quantization=int8: loss and gradients at the parameters "
                     f"dequantized from blocks of {block} of each rank's shard")
    if gblock:
        node = (plan.get("mesh") or {}).get("node")
        lines.append(f"gradient-quantization=int8: each rank's gradients quantized in parts "
                     f"and blocks of {gblock}, each part summed by its owner in float32"
                     + (f", in two levels (nodes of {node}: requantized between)"
                        if node else ""))
    total = sum(p.numel() for p in params.values())
    for n in params:
        extra = (f"  {tight[n]}/{params[n].numel()} elements under a tight bound"
                 if check.kind in ("adamw", "lamb") else "")
        lines.append(f"  {n:<40} max |diff| / allowed {worst[n]:.3f}{extra}")
    ok = all(w <= 1.0 for w in worst.values())
    if norm_worst is not None:
        lines.append(f"gradient norms vs clip_grad_norm_'s in float64, every step: "
                     f"{'MATCH' if norm_worst <= 1.0 else 'MISMATCH'} (worst "
                     f"{norm_worst:.2e} of the allowed difference, relative difference "
                     f"{norm_rel:.2e})")
        ok = ok and norm_worst <= 1.0
    if bf16_moments:
        m_ok = all(w <= 1.0 for w in moment_worst.values())
        what = "moments" if adam_like else "momentum buffer"
        worst_of = ", ".join(f"{k} {w:.3f}" for k, w in moment_worst.items())
        if four_bit:
            lines.append(f"4-bit {what} (blocks of {opts.get('state_block')}): each update from "
                         f"our stored (decoded) {what}, our new ones within half a level gap "
                         f"of float64's: {'MATCH' if m_ok else 'MISMATCH'} (worst {worst_of}"
                         f" of the allowed difference)")
        elif eight_bit:
            lines.append(f"8-bit {what} (blocks of {opts.get('state_block')}): each update from "
                         f"our stored (decoded) {what}, our new ones within half a code step "
                         f"of float64's: {'MATCH' if m_ok else 'MISMATCH'} (worst {worst_of}"
                         f" of the allowed difference)")
        else:
            lines.append(f"bf16 {what} ({opts.get('state_rounding')} rounding): each update from "
                         f"our stored {what}, our new ones within {rounding_places:g} bf16 place "
                         f"of float64's: {'MATCH' if m_ok else 'MISMATCH'} (worst {worst_of}"
                         f" of the allowed difference)")
        ok = ok and m_ok
    if ls:
        lines.append(f"loss scaling: {skipped_seen} of {log['steps']} steps skipped "
                     f"(overflow), Adam/momentum step count = applied steps; scale and "
                     f"skips as GradScaler: {'MATCH' if scaler_ok else 'MISMATCH'}")
        ok = ok and scaler_ok
    losses_ok = loss_worst <= args.rtol
    if check.kind in ("adamw", "lamb"):
        lines.append(f"  {sum(tight.values())}/{total} elements checked under the tight bound")
    worst_name = max(worst, key=worst.get)
    lines.append(f"updates: {'MATCH' if ok else 'MISMATCH'} (worst {worst_name}: "
                 f"{worst[worst_name]:.3f} of the allowed difference)")
    lines.append(f"our loss vs PyTorch float64 at our own parameters, every step: max "
                 f"relative difference {loss_worst:.3e} (tolerance {args.rtol:g})")
    lines.append(f"losses: {'MATCH' if losses_ok else 'MISMATCH'}")
    return ok and losses_ok, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "gpt", "llama"], required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=2, help="llama")
    ap.add_argument("--ffn", type=int, default=176, help="llama: MLP width")
    ap.add_argument("--rope-theta", type=float, default=10000.0, help="llama")
    ap.add_argument("--norm-eps", type=float, default=1e-5, help="llama: RMSNorm epsilon")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--dump-dir", required=True)
    ap.add_argument("--batches-dir", help="take the (global) batches from this dump "
                    "instead: a one-rank run of the same global batch, for N-rank runs "
                    "whose dump holds rank 0's batch only")
    ap.add_argument("--script", help="build the model with this fsdp-import script's "
                    "model() (the module fsdp-import imported) instead; --model and the "
                    "sizes still give the rounding-depth formula of the architecture")
    ap.add_argument("--init-from", help="with --script: the run started from this "
                    "checkpoint (fsdp-run --init-from: a .safetensors file, BF16/F16 widened "
                    "as load_state_dict copies), not from model()'s own values: the module "
                    "loads it, then the dump's initial parameters must equal it bit for bit")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="the model's dropout p (gen_models.py --dropout)")
    ap.add_argument("--seed", type=int, default=1234, help="fsdp-run's --seed")
    ap.add_argument("--label-smoothing", type=float, default=0.0,
                    help="the cross-entropy's label smoothing (gen_models.py gpt "
                    "--label-smoothing)")
    ap.add_argument("--ignore-index", type=int, default=None,
                    help="the cross-entropy's ignore_index (gen_models.py gpt --ignore-index)")
    ap.add_argument("--wrong-ignore-blocks", type=int, default=1,
                    help="negative control: normalize by K row blocks' kept means")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    DROPOUT["p"], DROPOUT["seed"] = args.dropout, args.seed
    LABEL_SMOOTHING["e"] = args.label_smoothing
    IGNORE["index"], IGNORE["blocks"] = args.ignore_index, args.wrong_ignore_blocks

    with open(args.plan) as f:
        plan = json.load(f)
    with open(f"{args.dump_dir}/log.json") as f:
        log = json.load(f)
    opts = plan["options"]
    inputs = [b["name"] for b in plan["inputs"] if b["role"] == "input"]
    targets = [b["name"] for b in plan["inputs"] if b["role"] == "target"]
    batches = read_safetensors(f"{args.batches_dir or args.dump_dir}/batches.safetensors")
    if getattr(args, "script", None):  # a PyTorch model's own: integer ids and labels are int64
        batches = {k: t if t.is_floating_point() else t.long() for k, t in batches.items()}
    first = batches[f"step1.{inputs[0]}"]
    args.batch = first.shape[0]
    model = build(args)
    init = read_safetensors(f"{args.dump_dir}/init.safetensors")
    if getattr(args, "script", None):
        # fsdp-import --weights + fsdp-run --init-from: training starts from
        # the module's own initial values, bit for bit.
        own = dict(model.named_parameters())
        whose = "the PyTorch module's own"
        if getattr(args, "init_from", None):  # a fine-tune from a checkpoint
            load_init(model, read_safetensors(args.init_from))
            whose = "the checkpoint's"
        same = all(torch.equal(init[n], own[n].detach()) for n in own if n in init)
        print(f"initial parameters {'are' if same else 'are NOT'} {whose}")
        if not same:
            return 1
    load_init(model, init)
    opt = make_optimizer(model, opts, log["lr"][0])

    worst = 0.0
    print(f"{'step':>5} {'fsdp-run':>14} {'pytorch f32':>14} {'rel diff':>10}")
    for step in range(1, log["steps"] + 1):
        for group in opt.param_groups:
            group["lr"] = log["lr"][step - 1]
        x = batches[f"step{step}.{inputs[0]}"]
        y = batches[f"step{step}.{targets[0]}"]
        DROPOUT["step"] = step
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        if opts.get("max_grad_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts["max_grad_norm"])
        opt.step()
        ours = log["losses"][step - 1]
        rel = abs(ours - loss.item()) / max(abs(loss.item()), 1e-12)
        worst = max(worst, rel)
        print(f"{step:>5} {ours:>14.8f} {loss.item():>14.8f} {rel:>10.2e}")
    # The free-running comparison is printed for information only: after
    # 20 steps it measures how chaotic the trajectory is (a relu that flips
    # on a rounding difference, AdamW normalizing rounding-level gradients)
    # as much as correctness. The checks are the teacher-forced ones below.
    print(f"free-running float32 PyTorch run: max relative loss difference {worst:.3e} "
          f"(information, not a check)")
    final = read_safetensors(f"{args.dump_dir}/final.safetensors")
    drift = max(((final[n] - p.detach()).abs().max() / p.detach().abs().max().clamp(min=1e-12)).item()
                for n, p in model.named_parameters())
    print(f"free-running float32 final parameters differ by up to {drift:.2e} of the "
          f"tensor's max (information, not a check)")

    trajectory = read_safetensors(f"{args.dump_dir}/trajectory.safetensors")
    updates_ok, lines = check_updates(args, opts, log, batches, inputs, targets,
                                      trajectory, init, plan)
    print("\n".join(lines))
    ok = updates_ok
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
