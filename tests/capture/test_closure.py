"""``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS): the closure's forward
and backward run inside ``step()`` after the pre-hooks; capture and watch do their pre-update
work when it returns (precisiondiff/capture/closure.py)."""
from __future__ import annotations

import torch
from torch import nn

import precisiondiff
from precisiondiff.capture.closure import after_closure
from precisiondiff.watch import read_logs


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model, opt, steps, *, closure, cap=None, w=None):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 6)

        def step_closure():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss
        if closure:
            opt.step(step_closure)
        else:
            step_closure()
            opt.step()
        for session in (cap, w):
            if session is not None:
                session.step()


def _events(path):
    return [(e.kind, e.scope, e.name, e.direction, e.step,
             [(t.slot, t.stats.get("mean") if t.stats else None) for t in e.tensors])
            for e in precisiondiff.load(path).events()]


def test_a_closure_step_is_captured_as_backward_then_step(tmp_path):
    for closure in (False, True):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with precisiondiff.capture(tmp_path / str(closure), model=model, level="all") as cap:
            _train(model, opt, 2, closure=closure, cap=cap)
    plain, closed = _events(tmp_path / "False"), _events(tmp_path / "True")
    assert any(e[3] == "optimizer" for e in plain) and any(e[0] == "param" for e in plain)
    assert closed == plain  # forward and backward not inside the update; the gradients recorded


def test_watch_reads_the_gradients_of_a_closure_step(tmp_path):
    logs = []
    for closure in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with precisiondiff.watch(tmp_path / str(closure), model=model, optimizer=opt, param_every=1) as w:
            _train(model, opt, 3, closure=closure, w=w)
        logs.append(read_logs(tmp_path / str(closure))[0].steps)
    grads = [[{k: v for k, v in step["params"].items()} for step in log] for log in logs]
    assert grads[0] == grads[1] and grads[0][0]


def test_the_closure_is_wrapped_once_positional_or_keyword():
    calls = []
    for args, kwargs in (((None, lambda: calls.append("closure") or 1), {}),
                         ((None,), {"closure": lambda: calls.append("closure") or 2})):
        new_args, new_kwargs = after_closure(args, kwargs, lambda: calls.append("work"))
        closure = new_args[1] if len(new_args) > 1 else new_kwargs["closure"]
        assert calls == [] and closure() in (1, 2) and closure() in (1, 2)
        assert calls == ["closure", "work", "closure"]
        calls.clear()
    assert after_closure((None,), {}, lambda: calls.append("work")) is None and calls == ["work"]
