"""A workload whose bf16 run diverges from float64 beyond the end-to-end budget: a custom op
that, in bf16 only, uses a crude approximation (x * sigmoid(x), i.e. SiLU for GELU)."""
import torch
from torch import nn

import precisiondiff


@torch.library.custom_op("pdcompare::rough_gelu", mutates_args=())
def rough_gelu(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return x * torch.sigmoid(x)
    return torch.nn.functional.gelu(x)


@rough_gelu.register_fake
def _(x):
    return torch.empty_like(x)


class Block(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(rough_gelu(self.fc1(x)))


def build_drift() -> precisiondiff.Workload:
    model = nn.Sequential(nn.Linear(16, 32), Block(), Block(), nn.Linear(32, 4))
    return precisiondiff.Workload(model, torch.randn(8, 16))
