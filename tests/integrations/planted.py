"""A small workload with a planted kernel bug, exportable with torch.export: a custom op that,
in bf16 only, computes GELU as x * sigmoid(x) (a crude approximation)."""
import torch
from torch import nn

import precisiondiff


@torch.library.custom_op("pdeco::rough_gelu", mutates_args=())
def rough_gelu(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return x * torch.sigmoid(x)
    return torch.nn.functional.gelu(x)


@rough_gelu.register_fake
def _(x):
    return torch.empty_like(x)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(rough_gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> precisiondiff.Workload:
    return precisiondiff.Workload(Net(), torch.randn(4, 8))
