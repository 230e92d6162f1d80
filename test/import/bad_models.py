"""Models fsdp-import must refuse, each with an error naming the op, the
module path and the source line. FSDP_IMPORT_CASE picks one."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CASE = os.environ.get("FSDP_IMPORT_CASE", "")


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("table", torch.arange(8.0))

    def forward(self, x):
        h = self.fc(x)
        if CASE == "exp":
            return torch.exp(h)
        if CASE == "tanh":
            return torch.tanh(h)
        if CASE == "dropout":
            return F.dropout(h, 0.1, True, True)
        if CASE == "inplace":
            h += 1.0
            return h
        if CASE == "const":
            return h * self.table
        if CASE == "shape":
            return h.view(3, -1)
        return h


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Inner()])
        self.head = nn.Linear(8, 1)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        if CASE == "not_scalar":
            return (self.head(x) - y) ** 2
        if CASE == "ce_weight":
            return F.cross_entropy(torch.cat([self.head(x), -self.head(x)], 1),
                                   (y > 0).long().view(-1), weight=torch.ones(2))
        return F.mse_loss(self.head(x), y)


def model():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    if CASE == "no_target_shape":
        return torch.randn(4, 7), torch.randn(4, 1)
    return torch.randn(4, 8), torch.randn(4, 1)
