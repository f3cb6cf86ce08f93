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


class MaskedAttention(nn.Module):
    """Attention with a padding mask filled the way T5 and most HF models fill it: with
    ``torch.finfo(dtype).min``, which differs between dtypes by design."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / 4.0
        keep = torch.ones(scores.shape[-1], dtype=torch.bool, device=x.device)
        keep[-2:] = False  # the last two positions are padding
        bias = torch.zeros((), dtype=scores.dtype, device=x.device).masked_fill(
            torch.tensor(True, device=x.device), torch.finfo(scores.dtype).min)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min) + torch.where(keep, 0.0, bias)
        return torch.softmax(scores, dim=-1) @ v


def build_masked() -> precisiondiff.Workload:
    return precisiondiff.Workload(MaskedAttention(), torch.randn(2, 6, 16))
