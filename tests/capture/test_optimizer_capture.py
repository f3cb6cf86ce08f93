"""Capture of parameter updates: optimizer.step(), GradScaler, clip_grad_norm_ (direction optimizer)."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

import precisiondiff
from precisiondiff.capture import optimizer as optim_capture
from precisiondiff.capture.runner import capture_script, capture_workload
from precisiondiff.capture.session import CaptureWarning
from precisiondiff.errors import WorkloadError
from precisiondiff.store.reader import iter_index


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def _lines(path):
    return [obj for _, obj, _ in iter_index(path)]


def _updates(path, name=None):
    return [e for e in _lines(path) if e["direction"] == "optimizer" and (name is None or e["name"] == name)]


def _train(model, opt, steps, cap=None, clip=None, scaler=None):
    torch.manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        if cap is not None:
            cap.step()


def test_fused_adamw_one_event_per_parameter_with_state_before_and_after(tmp_path):
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    _train(model, opt, 1)  # the moments exist: the captured step updates them
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with precisiondiff.capture(tmp_path / "d", model=model, mode="replay") as cap:
        _train(model, opt, 1, cap)
    fused = _updates(tmp_path / "d", "aten._fused_adamw_.default")
    assert [e["scope"] for e in fused] == [f"optimizer.param_groups.0/{n}" for n in PARAMS]
    dump = precisiondiff.load(tmp_path / "d")
    for e in fused:
        name = e["optimizer"]["param"]
        p = dict(model.named_parameters())[name]
        slots = {t["slot"]: t["key"] for t in e["tensors"]}
        # inputs: parameter, gradient, moments, step, before the update; outputs: what it wrote
        assert torch.equal(dump.tensor(slots["input.0"]), before[name])
        assert torch.equal(dump.tensor(slots["input.2"]), state[name]["exp_avg"])
        assert torch.equal(dump.tensor(slots["input.3"]), state[name]["exp_avg_sq"])
        assert torch.equal(dump.tensor(slots["output.0"]), p.detach())
        assert torch.equal(dump.tensor(slots["output.2"]), opt.state[p]["exp_avg"])
        assert torch.equal(dump.tensor(slots["output.3"]), opt.state[p]["exp_avg_sq"])
        assert not torch.equal(dump.tensor(slots["output.2"]), dump.tensor(slots["input.2"]))
        # the scalars: in the replay arguments and, readable, in the event's optimizer field
        assert e["args"]["kwargs"]["dict"]["lr"] == 0.05 and e["args"]["replayable"]
        assert e["optimizer"]["hyper"]["lr"] == 0.05 and e["optimizer"]["hyper"]["betas"] == [0.9, 0.999]
        assert e["optimizer"]["class"] == "AdamW" and e["optimizer"]["slice"][1] == 4
        assert e["optimizer"]["step"] == 2.0  # the counter, incremented by the _foreach_add_ before
        assert all(len(a) == 1 for a in e["args"]["args"] if isinstance(a, list) and a)


def test_foreach_adamw_every_list_op_sliced_by_parameter(tmp_path):
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    with precisiondiff.capture(tmp_path / "d", model=model, mode="tensors") as cap:
        _train(model, opt, 2, cap)
    ups = [e for e in _updates(tmp_path / "d") if e["name"].startswith("aten._foreach_")]
    names = {e["name"] for e in ups}
    assert {"aten._foreach_lerp_.Scalar", "aten._foreach_addcmul_.Scalar", "aten._foreach_sqrt.default",
            "aten._foreach_addcdiv_.ScalarList"} <= names
    for step in (0, 1):
        for name in names:
            scopes = [e["scope"] for e in ups if e["name"] == name and e["step"] == step]
            assert set(scopes) == {f"optimizer.param_groups.0/{p}" for p in PARAMS}, (name, step)
            assert len(scopes) % len(PARAMS) == 0  # each call: one event per parameter
    # keys keep the contract: {scope}/{name}#{call}:{direction}:{slot}, step-prefixed
    key = next(t["key"] for e in ups if e["step"] == 1 for t in e["tensors"])
    assert key.startswith("step1/optimizer.param_groups.0/") and ":optimizer:" in key


def test_clip_grad_norm_and_grad_scaler(tmp_path):
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with precisiondiff.capture(tmp_path / "d", model=model, mode="tensors") as cap:
        _train(model, opt, 1, cap, clip=1e-3, scaler=scaler)
    ups = _updates(tmp_path / "d")
    unscale = [e for e in ups if e["name"] == "aten._amp_foreach_non_finite_check_and_unscale_.default"]
    assert sorted(e["scope"] for e in unscale) == sorted(f"grad_scaler/{p}" for p in PARAMS)
    assert any(e["name"] == "aten._amp_update_scale_.default" and e["scope"] == "grad_scaler" for e in ups)
    norms = [e for e in ups if e["name"] == "aten._foreach_norm.Scalar"]
    assert sorted(e["scope"] for e in norms) == sorted(f"clip_grad_norm_/{p}" for p in PARAMS)
    assert any(e["scope"] == "clip_grad_norm_" and e["name"] == "aten.stack.default" for e in ups)
    # the optimizer's own update follows, its ops under the optimizer's scope
    assert any(e["scope"].startswith("optimizer.param_groups.0/") for e in ups)
    # parameter gradients are taken before unscale_ and clipping change them: the scaled ones
    dump = precisiondiff.load(tmp_path / "d")
    param = next(e for e in _lines(tmp_path / "d") if e["kind"] == "param" and e["scope"] == "fc1")
    grad = dump.tensor(next(t["key"] for t in param["tensors"] if t["slot"] == "param_grad.weight"))
    clipped = next(e for e in ups if e["name"] == "aten._foreach_mul_.Tensor" and e["scope"] == "clip_grad_norm_/fc1.weight")
    out = dump.tensor(next(t["key"] for t in clipped["tensors"] if t["slot"] == "output.0"))
    assert float(grad.norm()) > 100 * float(out.norm())


@pytest.mark.parametrize("where", ["list_slices", "written_tensors"])  # before the op runs, after it
def test_capture_leaves_the_training_bitwise_unchanged(tmp_path, monkeypatch, where):
    def run(capture_dir=None, broken=False):
        torch.manual_seed(0)
        model = Mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
        if capture_dir is None:
            _train(model, opt, 3)
        else:
            with precisiondiff.capture(capture_dir, model=model, mode="tensors") as cap:
                _train(model, opt, 3, cap)
            if broken:
                assert cap.errors and "planted" in cap.errors[0]
        return [p.detach().clone() for p in model.parameters()]
    plain = run()
    assert all(torch.equal(a, b) for a, b in zip(plain, run(tmp_path / "ok")))

    def fail(*args, **kwargs):
        raise RuntimeError("planted capture failure")
    monkeypatch.setattr(optim_capture, where, fail)
    with pytest.warns(CaptureWarning):
        broken = run(tmp_path / "broken", broken=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, broken))


def test_training_workload_capture(tmp_path):
    out = tmp_path / "d"
    capture_workload("tests/bisect/planted_optim.py:stock_adamw_foreach", out, target="cpu/bf16")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["steps"] == 2 and meta["optimizer"] is True
    assert meta["observer_effect"]["bitwise_equal"] is True
    assert any(c.startswith("param.") for c in meta["observer_effect"]["checked"]) or \
        len(meta["observer_effect"]["checked"]) > 8
    steps = {(e["step"], e["direction"]) for e in _lines(out)}
    assert {(0, "optimizer"), (1, "optimizer"), (1, "forward"), (1, "backward")} <= steps


def test_script_capture_records_the_update_in_its_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True)
        for _ in range(2):
            m(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    """))
    capture_script(str(script), [], tmp_path / "d")
    lines = _lines(tmp_path / "d")
    for step in (0, 1):
        ups = [e for e in lines if e["step"] == step and e["direction"] == "optimizer"]
        assert {e["scope"] for e in ups if e["name"].startswith("aten._foreach_")} == \
            {"optimizer.param_groups.0/weight", "optimizer.param_groups.0/bias"}
        last = max(e["seq"] for e in lines if e["step"] == step)
        assert max(e["seq"] for e in ups) == last  # the update ends the step


def test_list_slices():
    a, b = [torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(3)]
    calls = optim_capture.list_slices(torch.ops.aten._foreach_div_.ScalarList, "aten._foreach_div_.ScalarList",
                                      (a, [2.0, 4.0]), {})
    assert [(len(x[0]), x[1]) for x, _ in calls] == [(1, [2.0]), (1, [4.0])]
    assert calls[1][0][0][0] is a[1]
    calls = optim_capture.list_slices(torch.ops.aten._foreach_add_.List, "aten._foreach_add_.List", (a, b),
                                      {"alpha": 2})
    assert len(calls) == 2 and calls[0][1] == {"alpha": 2} and calls[0][0][1][0] is b[0]
    # stack takes a list, but each output element depends on all of it: one event
    assert optim_capture.list_slices(torch.ops.aten.stack.default, "aten.stack.default", (a,), {}) is None
    assert optim_capture.written_tensors(torch.ops.aten.add_.Tensor, (a[0], b[0]), {}, a[0]) == [a[0]]
    out = torch.ops.aten._foreach_sqrt.default(a)
    assert optim_capture.written_tensors(torch.ops.aten._foreach_sqrt.default, (a,), {}, out) == out


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be a positive int"),
    ({"scheduler": lambda o: None}, "needs an optimizer"),
    ({"optimizer": torch.optim.SGD, "loss": None}, "needs a loss"),
])
def test_training_workload_options_are_checked(kwargs, message):
    fields = {"loss": lambda y: y.sum(), **kwargs}
    with pytest.raises(WorkloadError, match=message):
        precisiondiff.runtime.workload.load_workload(lambda: precisiondiff.Workload(nn.Linear(2, 2), torch.ones(1, 2),
                                                                                    **fields))


def test_training_workload_with_scaler_and_scheduler(tmp_path):
    out = tmp_path / "d"
    capture_workload("tests/bisect/planted_optim.py:scaled_adamw", out, target="cpu/bf16+autocast")
    ups = _updates(out)
    for step in (0, 1):
        names = {e["name"] for e in ups if e["step"] == step and e["scope"].startswith("grad_scaler")}
        assert {"aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._amp_update_scale_.default"} <= names
    lrs = {e["step"]: e["optimizer"]["hyper"]["lr"] for e in ups if "hyper" in e["optimizer"]}
    assert lrs == {0: 0.01, 1: 0.005}  # StepLR(gamma=0.5) stepped after each update
    assert json.loads((out / "meta.json").read_text())["observer_effect"]["bitwise_equal"] is True
