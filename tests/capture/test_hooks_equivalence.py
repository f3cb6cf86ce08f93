"""The module hooks record exactly what the previous ones did: the same events (module, param,
and at the ``all`` level the ops with their backward scopes), to the last bit, and the same dump
index byte for byte, over several sessions on the same model.

The oracle is ``legacy_hooks.py`` (the hooks before the 2026-12-03 speed pass, frozen), whose
methods come first in a subclass of the current session."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from precisiondiff.capture import MemorySink, capture
from precisiondiff.capture import session as session_mod
from precisiondiff.store.schema import INDEX

from . import legacy_hooks

LegacySession = type("LegacySession", (legacy_hooks.ModuleHooks, session_mod.CaptureSession), {})


class _Pair(nn.Module):
    """Two outputs (a tuple) from one input; the second output needs no gradient."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, 2 * dim)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, dim=-1)
        return a, b.detach() * 2.0


class _Gate(nn.Module):
    """Called with keyword arguments, and twice per step (a shared module)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim) / 4)

    def forward(self, x, *, scale=None, bias: float = 0.0):
        y = x * self.w + bias
        return y if scale is None else y * scale


class _Net(nn.Module):
    """What the hooks special-case: an identity submodule (Dropout in eval mode), an in-place op
    on a module's output, a leaf input that requires gradients, a branch not in the loss, a module
    called with keyword tensors, a shared module, activation checkpointing, nested tuples."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.pair = _Pair(dim)
        self.gate = _Gate(dim)
        self.drop = nn.Dropout(0.5)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.side = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x, extra):
        h = self.inp(x)
        h.mul_(1.25)  # in place on a module's output
        a, b = self.pair(h)
        g = self.gate(a, scale=extra)
        g = self.gate(self.drop(g) + b, bias=0.5)
        r = self.act(g)
        h = checkpoint(self.block, r, use_reentrant=False) + self.block(r)
        self.side(h.detach())  # not in the loss: its backward never arrives
        return self.head(h + extra)


def _train(model: nn.Module, n_steps: int, sessions: int, dtype, make, **kw) -> list:
    """``sessions`` capture sessions of ``n_steps`` steps each (with an SGD step) on one model."""
    torch.manual_seed(3)
    x = torch.randn(4, 8)
    extra = torch.randn(4, 8, requires_grad=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    for s in range(sessions):
        with make(s, model=model, **kw) as cap:
            for _ in range(n_steps):
                with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                    loss = model(x, extra).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                cap.step()
        assert not cap.errors
        out.append(cap)
    return out


def _sinks(monkeypatch, model, level, dtype, **kw):
    both = []
    for cls in (session_mod.CaptureSession, LegacySession):
        with monkeypatch.context() as m:
            m.setattr(session_mod, "CaptureSession", cls)
            sinks = []

            def make(s, **kwargs):
                sinks.append(MemorySink())
                return capture(sink=sinks[-1], level=level, **kwargs)
            _train(copy.deepcopy(model), 2, 2, dtype, make, **kw)
            both.append(sinks)
    return both


def _same(new: list, old: list) -> None:
    for a, b in zip(new, old):
        assert len(a.events) == len(b.events) > 10
        for x, y in zip(a.events, b.events):
            assert repr(x) == repr(y)  # floats to the last bit, NaN equal to NaN, key order


@pytest.mark.parametrize("level", ["module", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_events_are_those_of_the_previous_hooks(monkeypatch, level, dtype):
    torch.manual_seed(0)
    new, old = _sinks(monkeypatch, _Net(), level, dtype)
    _same(new, old)
    kinds = {(e["kind"], e["direction"]) for e in new[1].events}
    assert {("module", "forward"), ("module", "backward"), ("param", "backward")} <= kinds


def test_the_example_transformer_with_filters_and_replay(monkeypatch):
    from examples.tiny_transformer import build

    class _Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = build().model

        def forward(self, x, extra):
            return self.model(torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5)))

    torch.manual_seed(0)
    model = _Wrapped()
    for kw in ({"scope": r"attn|mlp\.fc2", "mode": "replay"}, {"scope_exclude": "norm", "steps": "1"}):
        new, old = _sinks(monkeypatch, model, "all", torch.bfloat16, **kw)
        _same(new, old)


def test_global_hooks_record_what_the_previous_ones_did(monkeypatch):
    torch.manual_seed(0)
    base = _Net()
    both = []
    for cls in (session_mod.CaptureSession, LegacySession):
        with monkeypatch.context() as m:
            m.setattr(session_mod, "CaptureSession", cls)
            sinks = []

            def make(s, model, **kwargs):
                sinks.append(MemorySink())
                return capture(sink=sinks[-1], level="all")
            _train(copy.deepcopy(base), 2, 2, torch.float32, make)
            both.append(sinks)
    _same(*both)


def test_a_dump_index_is_the_previous_hooks_byte_for_byte(monkeypatch, tmp_path):
    from examples.tiny_transformer import build

    work = build()
    index = []
    for cls in (session_mod.CaptureSession, LegacySession):
        with monkeypatch.context() as m:
            m.setattr(session_mod, "CaptureSession", cls)
            model = copy.deepcopy(work.model).to(torch.bfloat16)
            for s in range(2):  # a session per step, as the benchmark does
                out = tmp_path / f"{cls.__name__}{s}"
                with capture(out, model=model, level="module", mode="stats"):
                    work.loss(model(work.inputs)).backward()
                    model.zero_grad(set_to_none=True)
                index.append((out / INDEX).read_bytes())
    assert index[:2] == index[2:] and index[0] == index[1] and index[0].count(b"\n") > 40


def test_hooks_are_gone_after_a_session():
    model = _Net()
    counts = lambda: [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]  # noqa: E731
    before = counts()
    params = [getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters()]
    with capture(model=model, sink=MemorySink(), level="module"):
        assert counts() != before
    assert counts() == before
    assert all(not h for h in (getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters()))
    assert len(params) == len(list(model.parameters()))


def test_a_closed_session_is_freed_with_what_it_recorded():
    """The graph's hooks hold their session (through C++ nodes the cycle collector cannot see):
    a closed session must not hold the graph, or neither is ever freed."""
    import gc
    import weakref

    model = _Net()
    x, extra = torch.randn(4, 8), torch.randn(4, 8, requires_grad=True)
    refs = []
    for _ in range(2):
        with capture(model=model, sink=MemorySink(), level="module") as cap:
            model(x, extra).sum().backward()
        refs.append(weakref.ref(cap))
        del cap
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_the_collectors_threshold_is_put_back():
    import gc

    model = _Net()
    before = gc.get_threshold()
    with capture(model=model, sink=MemorySink(), level="module"):
        assert gc.get_threshold()[0] > before[0]
    assert gc.get_threshold() == before
    try:
        with capture(model=model, sink=MemorySink(), level="module"):
            gc.set_threshold(123, *before[1:])  # the program's own choice stays
        assert gc.get_threshold() == (123, *before[1:])
    finally:
        gc.set_threshold(*before)
