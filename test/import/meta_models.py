"""Models whose parameters are on the meta device, for fsdp-import.
FSDP_IMPORT_CASE picks one:

  user_meta    model() builds every parameter on meta itself (device="meta",
               as torch 2's `with torch.device("meta")` would) and
               initializes it there; the causal mask is a CPU buffer; the
               position ids are torch.arange(T, device=idx.device) and the
               mask is moved with .to(x.device): both must stay constants
               with values although the trace runs on meta. The initializers
               are recorded (kaiming_uniform_ through .data, normal_ with a
               std, ones_, zeros_).
  meta_buffer  the same with the causal mask built on meta: it has no value,
               so the attention pattern cannot be recognised: an error
               naming the buffer.
  prebuilt     the module is built on meta when the script is loaded, before
               model() runs: fsdp-import sees no initializer (a warning;
               init("normal", 0.02) assumed).
"""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CASE = os.environ.get("FSDP_IMPORT_CASE", "user_meta")
V, T, C, H, B = 64, 8, 32, 4, 2
META = torch.device(os.environ.get("FSDP_IMPORT_DEVICE", "meta"))  # cpu: the same model with values


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C, device=META)
        self.proj = nn.Linear(C, C, device=META)
        mask_device = META if CASE == "meta_buffer" else "cpu"
        self.register_buffer("mask", torch.tril(torch.ones(T, T, device=mask_device))
                             .view(1, 1, T, T))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(b, t, H, c // H).transpose(1, 2)
        k = k.view(b, t, H, c // H).transpose(1, 2)
        v = v.view(b, t, H, c // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask.to(x.device)[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C, device=META)
        self.attn = Attention()

    def forward(self, x):
        return x + self.attn(self.ln(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C, device=META)
        self.wpe = nn.Embedding(T, C, device=META)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(C, V, bias=False, device=META)
        # Initialized on meta: no values, but the initializers are recorded.
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        for blk in self.blocks:
            nn.init.kaiming_uniform_(blk.attn.qkv.weight.data, a=math.sqrt(5))
            nn.init.zeros_(blk.attn.qkv.bias)
            nn.init.normal_(blk.attn.proj.weight, std=0.02 / math.sqrt(4))

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


PREBUILT = Model() if CASE == "prebuilt" else None


def model():
    return PREBUILT if PREBUILT is not None else Model()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, V, (B, T), generator=g)
    return idx, torch.roll(idx, -1, dims=1)
