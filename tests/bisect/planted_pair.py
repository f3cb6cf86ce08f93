"""Two planted kernels in one model, for the offender list and --accept (tests/bisect/test_culprits.py)."""
from __future__ import annotations

import torch
from torch import nn

from precisiondiff import Workload


def _sloppy(x: torch.Tensor, factor: float) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return (x.float() * factor).to(x.dtype)  # the bug: a stale scale on the bf16 path only
    return x.clone()


@torch.library.custom_op("pdpair::first", mutates_args=())
def first(x: torch.Tensor) -> torch.Tensor:
    return _sloppy(x, 1 + 2 ** -4)


@first.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("pdpair::second", mutates_args=())
def second(x: torch.Tensor) -> torch.Tensor:
    return _sloppy(x, 1 - 2 ** -4)


@second.register_fake
def _(x):
    return torch.empty_like(x)


class Block(nn.Module):
    def __init__(self, planted: str, dim: int = 32):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.planted = planted  # the op's name: a module holding the op object cannot be deep-copied

    def forward(self, x):
        return getattr(torch.ops.pdpair, self.planted)(torch.tanh(self.fc(x)))


class TwoBugs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Block("first")
        self.b = Block("second")
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def two_bugs_workload() -> Workload:
    return Workload(TwoBugs(), torch.randn(16, 32))
