"""A small decoder stack with a planted bf16-accumulating GEMM in a late block, for the
block-wise replay and replay-worker tests (the same shape of plant as benchmarks/bench_scale.py,
at dims <= 48 so a capture takes a second)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from precisiondiff import Workload

DIM, HIDDEN, VOCAB, LAYERS, SEQ = 32, 48, 40, 4, 12
PLANTED_LAYER = LAYERS - 2


@torch.library.custom_op("pdblocks::acc_linear", mutates_args=())
def acc_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T``; in bf16 the running sum over the reduction is rounded to bf16 every 4 products."""
    if x.dtype != torch.bfloat16:
        return F.linear(x, w)
    acc = None
    for k in range(0, x.shape[-1], 4):
        part = F.linear(x[..., k:k + 4].float(), w[:, k:k + 4].float())
        acc = part.to(x.dtype) if acc is None else (acc.float() + part).to(x.dtype)
    return acc


@acc_linear.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w, grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


acc_linear.register_autograd(_backward, setup_context=_setup)


class Block(nn.Module):
    def __init__(self, planted: bool = False):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.mix = nn.Linear(DIM, DIM, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.planted = planted

    def forward(self, x):
        h = x + self.mix(self.norm(x))
        a = F.silu(self.gate(h)) * self.up(h)
        return h + (acc_linear(a, self.down.weight) if self.planted else self.down(a))


class Decoder(nn.Module):
    def __init__(self, plant: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(plant and i == PLANTED_LAYER) for i in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class GainBlock(Block):
    """A block scaling its output by a tensor held as a plain attribute: not a parameter or a
    buffer, so no ``param.*`` slot records it and a template built on the meta device lacks it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.linspace(0.5, 1.5, DIM)

    def forward(self, x):
        return super().forward(x) * self.gain.to(x.dtype)


def _workload(plant: bool, gain: bool = False) -> Workload:
    ids = torch.randint(0, VOCAB, (2, SEQ))
    labels = torch.randint(0, VOCAB, (2, SEQ))
    model = Decoder(plant)
    if gain:
        model.layers[0] = GainBlock()
    return Workload(model, ids,
                    loss=lambda out: F.cross_entropy(out.float().reshape(-1, VOCAB), labels.reshape(-1)))


def planted_workload() -> Workload:
    """The plant in ``layers.2`` (of 4), forward and backward."""
    return _workload(True)


def clean_workload() -> Workload:
    """The same stack without the plant."""
    return _workload(False)


def gain_workload() -> Workload:
    """The planted stack whose first block holds a plain tensor attribute (:class:`GainBlock`)."""
    return _workload(True, gain=True)
