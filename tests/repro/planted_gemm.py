"""A planted bf16 GEMM as a custom op (torch.library), for the repro tests: its bf16 path drops
the last term of every dot product (an off-by-one in the K loop). ``PDREPRO_PLANT=0`` in the
environment fixes it, so a repro can be run against the broken and the fixed kernel. Imports
torch only: the repro tests copy this file into an isolated process (``REPRO_IMPORT``)."""
from __future__ import annotations

import os

import torch
from torch import nn


@torch.library.custom_op("pdrepro::matmul", mutates_args=())
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.bfloat16 and os.environ.get("PDREPRO_PLANT", "1") != "0":
        return (a[..., :-1].float() @ b[:-1].float()).to(a.dtype)
    return a @ b


@matmul.register_fake
def _(a, b):
    return a.new_empty(a.shape[:-1] + b.shape[-1:])


class PlantedNet(nn.Module):
    """A linear layer, a tanh, then the planted GEMM with a weight of its own."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)

    def forward(self, x):
        return torch.ops.pdrepro.matmul(torch.tanh(self.fc(x)), self.weight)


def workload():
    from precisiondiff import Workload
    return Workload(PlantedNet(), torch.randn(16, 32))
