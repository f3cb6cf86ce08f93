"""A module's grad_input when one of its inner modules returns several outputs (a fused QKV
projection's q, k, v): the inner call is reached once per output, and its input's gradient is
counted once (it was summed once per output: torchtitan's attention grad_input 3x too large)."""
from __future__ import annotations

import torch
from torch import nn

from precisiondiff.capture import MemorySink, capture


class _FusedQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.w(x).split(8, dim=-1)
        return q * 0.5, k.tanh(), v.exp()  # three outputs, three different autograd nodes


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = _FusedQKV()

    def forward(self, x):
        q, k, v = self.qkv(x)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def test_grad_input_counts_an_inner_call_with_several_outputs_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Attention()).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    seen = {}

    def hook(module, inputs, output):
        inputs[0].register_hook(lambda g: seen.update(grad=g.clone()))
    model[1].register_forward_hook(hook)
    sink = MemorySink()
    with capture(model=model, level="module", mode="tensors", sink=sink):
        model(x).pow(2).sum().backward()
    grads = {}
    for ev in sink.events:
        if ev["direction"] == "backward" and ev["scope"] in ("1", "1.qkv"):
            grads[ev["scope"]] = sink.tensor(next(r for r in ev["tensors"] if r["slot"] == "grad_input.0"))
    assert torch.equal(grads["1"], seen["grad"])
    assert torch.equal(grads["1.qkv"], seen["grad"])  # the inner call's own: the same edge
