"""Module backward capture through an identity submodule (Dropout in eval mode returns its input)."""
from __future__ import annotations

import torch
from torch import nn

from precisiondiff.capture import MemorySink, capture


class _Residual(nn.Module):
    """``x + drop(fc(norm(x)))``: ``drop`` returns its input unchanged in eval mode."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc, self.drop = nn.LayerNorm(8), nn.Linear(8, 8), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc(self.norm(x)))


def test_grad_input_keeps_the_path_through_an_identity_submodule():
    model = nn.Sequential(nn.Linear(8, 8), _Residual(), nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    seen = {}

    def hook(module, inputs, output):
        inputs[0].register_hook(lambda g: seen.setdefault("grad", g))
    model[1].register_forward_hook(hook)
    sink = MemorySink()
    with capture(model=model, level="module", mode="tensors", sink=sink):
        model(x).pow(2).sum().backward()
    event = next(e for e in sink.events if e["scope"] == "1" and e["direction"] == "backward")
    record = next(r for r in event["tensors"] if r["slot"] == "grad_input.0")
    assert torch.equal(sink.tensor(record), seen["grad"])
