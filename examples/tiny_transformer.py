"""A small decoder-only transformer written with torch.nn: the bundled example workload.

``build()`` is a clean model. ``build_with_bug()`` swaps its RMSNorm for a fused kernel
registered as a custom op (``pdexample::fused_rms_norm``, the way vendor libraries expose fused
kernels) whose bf16 path accumulates the sum of squares in bf16 — a real class of kernel bug.
Both use random initialization; nothing is downloaded.

    precisiondiff capture examples/tiny_transformer.py:build -o runs/dut
    precisiondiff bisect examples/tiny_transformer.py:build_with_bug
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import precisiondiff

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 2, 16, 2


@torch.library.custom_op("pdexample::fused_rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as one fused kernel. Planted bug: in bf16 the sum of squares is accumulated in bf16."""
    if x.dtype == torch.bfloat16:
        acc = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        for i in range(x.shape[-1]):  # a sequential bf16 accumulator, as a buggy kernel would do
            acc = acc + x[..., i] * x[..., i]
        variance = acc / x.shape[-1]
    else:
        variance = x.pow(2).mean(-1)
    return x * torch.rsqrt(variance + eps).unsqueeze(-1) * weight


@fused_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _rms_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    xf, gf, wf = x.float(), grad.float(), weight.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    normed = xf * rstd
    grad_weight = (gf * normed).reshape(-1, x.shape[-1]).sum(0)
    gn = gf * wf
    grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


fused_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.eps, self.fused = eps, fused

    def forward(self, x):
        if self.fused:
            return fused_rms_norm(x, self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, fused_norm: bool = False):
        super().__init__()
        self.norm1 = RMSNorm(dim, fused=fused_norm)
        self.attn = Attention(dim, heads)
        self.norm2 = RMSNorm(dim, fused=fused_norm)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, fused_norm=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, fused_norm) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _workload(fused_norm: bool, layers: int = LAYERS) -> precisiondiff.Workload:
    model = TinyTransformer(layers=layers, fused_norm=fused_norm)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))

    def loss(logits):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.to(logits.device).reshape(-1))

    return precisiondiff.Workload(model, tokens, loss=loss)


def build() -> precisiondiff.Workload:
    """The clean example: 2 blocks, training step (forward + backward)."""
    return _workload(fused_norm=False)


def build_with_bug() -> precisiondiff.Workload:
    """The same model whose RMSNorm is the buggy fused kernel ``pdexample::fused_rms_norm``."""
    return _workload(fused_norm=True)


def build_12_layers() -> precisiondiff.Workload:
    """A 12-block version for the benchmarks."""
    return _workload(fused_norm=False, layers=12)
