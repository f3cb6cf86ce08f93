"""Emulation from the op replays and from the golden replay (bisect/reuse.py): exact, never an
approximation."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.bisect import bisect
from precisiondiff.bisect import engine
from precisiondiff.bisect.isolate import UnitEvent
from precisiondiff.bisect.reuse import ReplayedOps, RoundedOps

from . import planted


def _event(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> UnitEvent:
    tensors = {"input.0": x, "input.1": y, "output.0": out}
    slots = {s: (str(t.dtype).removeprefix("torch."), tuple(t.shape), True) for s, t in tensors.items()}
    args = {"replayable": True, "args": [{"t": "input.0"}, {"t": "input.1"}], "kwargs": {"dict": {}}}
    return UnitEvent(0, "op", "", "aten.mul.Tensor", "forward", 0, slots, args, tensors.__getitem__)


def test_a_correctly_rounded_call_is_reused_only_for_exactly_its_arguments():
    x, y = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    golden = x.double() * y.double()
    reuse = RoundedOps("cpu", torch.float64, torch.bfloat16)
    assert reuse.add(_event(x, y, golden.bfloat16()), [golden], torch.ops.aten.mul.Tensor)
    hit = reuse.lookup("aten.mul.Tensor", (x.double(), y.double()), {})
    assert hit is not None and hit.dtype == torch.float64 and torch.equal(hit, golden.bfloat16().double())
    other = y.double().clone()
    other[-1, -2] += 1.0  # same key (shapes, first and last element), other values
    assert reuse.lookup("aten.mul.Tensor", (x.double(), other), {}) is None
    assert reuse.lookup("aten.add.Tensor", (x.double(), y.double()), {}) is None
    # a DUT output one ULP off its rounded golden is not registered: the emulation must run the op
    off = golden.bfloat16()
    off.view(torch.int16)[0, 0] += 1
    assert not RoundedOps("cpu", torch.float64, torch.bfloat16).add(_event(x, y, off), [golden],
                                                                     torch.ops.aten.mul.Tensor)


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("factory", [planted.ill_conditioned_workload, planted.bad_backward_workload,
                                     planted.vendor_workload])
def test_module_judgements_are_bit_identical_with_and_without_reuse(factory, monkeypatch):
    seen = []
    run_search = engine.run_search

    def spy(inp):
        out = run_search(inp)
        seen.append({uid: (d.get("local"), d.get("over"), d.get("far")) for uid, d in out.details.items()
                     if out.units[uid].kind == "module"})
        return out
    monkeypatch.setattr("precisiondiff.bisect.live.run_search", spy)
    with_reuse = bisect(factory, target="cpu/bf16")
    monkeypatch.setattr(RoundedOps, "lookup", lambda self, *a, **k: None)
    monkeypatch.setattr(ReplayedOps, "lookup", lambda self, *a, **k: None)
    without = bisect(factory, target="cpu/bf16")
    assert with_reuse.cost["ops_reused"] > 0 and without.cost["ops_reused"] == 0
    assert seen[0] == seen[1] and with_reuse.verdict == without.verdict and with_reuse.culprit == without.culprit
    assert with_reuse.cost["forward_equivalents"] < without.cost["forward_equivalents"]


def test_the_golden_replay_gives_its_first_level_calls_to_the_emulation_rounded():
    x = torch.randn(4, 8).bfloat16().double()  # exact in bf16: a module input, upcast
    w = torch.randn(8, 8).bfloat16().double()
    replayed = ReplayedOps(torch.bfloat16)
    mm = torch.ops.aten.mm.default
    golden = mm(x, w)
    replayed.record("aten.mm.default", mm, (x, w), {}, golden)
    replayed.record("aten.mm.default", mm, (golden, w), {}, mm(golden, w))  # not exact in bf16: not kept
    hit = replayed.lookup("aten.mm.default", (x.clone(), w.clone()), {}, torch.bfloat16)
    assert torch.equal(hit, golden.bfloat16().double())
    assert replayed.lookup("aten.mm.default", (golden.bfloat16().double(), w), {}, torch.bfloat16) is None
