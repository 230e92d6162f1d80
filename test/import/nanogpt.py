"""A GPT-2 written the way nanoGPT writes it (module classes, a registered
causal-mask buffer, split + view + transpose attention, dropout, tied LM
head, nanoGPT's initialization), for fsdp-import. Sizes from the environment
(FSDP_IMPORT_VOCAB, _CTX, _LAYERS, _HEADS, _WIDTH, _BATCH): the defaults are
examples/gpt_small.mlir's. FSDP_IMPORT_LABEL_SMOOTHING sets the loss's
label_smoothing (0 by default), FSDP_IMPORT_IGNORE_INDEX its ignore_index
(not passed by default)."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _sdpa_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
    """F.scaled_dot_product_attention where torch lacks it (Debian's 1.13):
    dispatched through __torch_function__ under the same name, as torch 2's is."""
    if torch.overrides.has_torch_function((q, k, v)):
        return torch.overrides.handle_torch_function(
            _sdpa_reference, (q, k, v), q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal)
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return att.softmax(-1) @ v


_sdpa_reference.__name__ = "scaled_dot_product_attention"
scaled_dot_product_attention = getattr(F, "scaled_dot_product_attention", _sdpa_reference)
FLASH = os.environ.get("FSDP_IMPORT_SDPA", "0") == "1"
EXACT_GELU = os.environ.get("FSDP_IMPORT_GELU", "tanh") == "exact"


def env(name, default):
    return int(os.environ.get(f"FSDP_IMPORT_{name}", default))


class Config:
    vocab_size = env("VOCAB", 256)
    block_size = env("CTX", 32)
    n_layer = env("LAYERS", 2)
    n_head = env("HEADS", 4)
    n_embd = env("WIDTH", 64)
    batch = env("BATCH", 4)
    dropout = float(os.environ.get("FSDP_IMPORT_DROPOUT", "0"))
    label_smoothing = float(os.environ.get("FSDP_IMPORT_LABEL_SMOOTHING", "0"))
    # nanoGPT itself passes ignore_index=-1; set, it is passed here too.
    ignore_index = (int(os.environ["FSDP_IMPORT_IGNORE_INDEX"])
                    if "FSDP_IMPORT_IGNORE_INDEX" in os.environ else None)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if FLASH:  # nanoGPT's flash path
            y = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                             is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        # GPT-2's tanh GELU; FSDP_IMPORT_GELU=exact for nanoGPT's own nn.GELU()
        self.gelu = nn.GELU() if EXACT_GELU else nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:  # fsdp-import --loss cross_entropy appends it
            return logits
        kw = {} if self.config.ignore_index is None else {"ignore_index": self.config.ignore_index}
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               label_smoothing=self.config.label_smoothing, **kw)


def model():
    torch.manual_seed(0)
    return GPT(Config())


def example_inputs():
    c = Config()
    idx = torch.randint(0, c.vocab_size, (c.batch, c.block_size))
    return idx, torch.roll(idx, -1, dims=1)
