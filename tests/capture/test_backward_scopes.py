"""Backward ops carry the scope of the module whose forward created them, also when the step ran
other forwards before (gradient accumulation, an evaluation forward, a forward under
``suspended()``) whose autograd graphs are gone by then: the Python wrappers of a new graph's
nodes may take the addresses of the old ones."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from precisiondiff.capture import MemorySink, capture
from precisiondiff.capture import compiled

from .test_capture_equivalence import _Block, _ids

ENGINES = ["python"] + (["compiled"] if compiled.load() is not None else [])


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.head = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(ids).reshape(1, 1)).sum()


def _backward_scopes(model: nn.Module, ids: torch.Tensor, engine: str, before: int, scope=None) -> list:
    sink = MemorySink()
    with capture(model=model, sink=sink, level="op", engine=engine, scope=scope) as cap:
        for i in range(before):  # forwards whose graphs die before the one that is differentiated
            if i % 2:
                with cap.suspended():
                    model(ids)
            else:
                model(ids)
        torch.autograd.grad(model(ids), [p for p in model.parameters() if p.requires_grad])
    return [(e["scope"], e["name"]) for e in sink.events if e["direction"] == "backward"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("scope", [None, "norm|proj|head.2"])
def test_earlier_forwards_of_the_step_do_not_change_the_backward_scopes(engine, scope):
    torch.manual_seed(0)
    model = _Nested().train(False)
    ids = _ids()
    alone = _backward_scopes(copy.deepcopy(model), ids, engine, before=0, scope=scope)
    assert alone and {s for s, _ in alone} >= ({"block.proj", "head.2"} if scope is None else {"head.2"})
    for before in (1, 2, 5):
        assert _backward_scopes(copy.deepcopy(model), ids, engine, before=before, scope=scope) == alone
