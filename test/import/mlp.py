"""The FSDP2 tutorial MLP written the usual way (nn.Module classes), for
fsdp-import: blocks of Linear -> ReLU -> Linear, a Linear(h, 1) head,
BCE with logits. Sizes from the environment (FSDP_IMPORT_HIDDEN, ..._BLOCKS,
..._BATCH) so tests can vary them."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN = int(os.environ.get("FSDP_IMPORT_HIDDEN", 64))
BLOCKS = int(os.environ.get("FSDP_IMPORT_BLOCKS", 8))
BATCH = int(os.environ.get("FSDP_IMPORT_BATCH", 32))


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


class MLP(nn.Module):
    def __init__(self, dim, blocks):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return F.binary_cross_entropy_with_logits(self.head(x), y)


def model():
    torch.manual_seed(0)
    return MLP(HIDDEN, BLOCKS)


def example_inputs():
    x = torch.randn(BATCH, HIDDEN)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()
