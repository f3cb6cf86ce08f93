"""The DeepSpeed ZeRO adapter (precisiondiff/capture/deepspeed.py) without DeepSpeed: an engine
stand-in that, like ZeRO-1/2, moves each gradient out of ``p.grad`` into its own buffers as
autograd accumulates it and clips them in its ``step()``. The real engine is tested in
tests/frameworks/test_deepspeed.py (skipped where DeepSpeed is not installed)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import precisiondiff
from precisiondiff.capture.deepspeed import zero_gradient
from precisiondiff.capture.recorder import MemorySink


@dataclass
class _Address:
    numel: int
    start: int = 0


class _Mapping:
    """DeepSpeed's ``tensor_fragment`` as ZeRO links a parameter to its gradient partition."""

    def __init__(self, optimizer: "_ZeroOptimizer", numel: int) -> None:
        self.optimizer, self.lp_fragment_address = optimizer, _Address(numel)

    def get_lp_grad_fragment(self, index: int) -> torch.Tensor:
        grads = self.optimizer.averaged_gradients
        if grads is None:
            raise ValueError("Gradients are only available immediately after backward and before engine step")
        return grads[index]


class _ZeroOptimizer:
    """Keeps each reduced gradient (flattened) in ``averaged_gradients``, empties ``p.grad``; its
    ``step()`` clips them by half and frees them, as DeepSpeedZeroOptimizer does."""

    def __init__(self, params, split: int = -1) -> None:
        self.bit16_groups = [list(params)]
        self.averaged_gradients = {}
        for i, p in enumerate(self.bit16_groups[0]):
            p._index_in_param_group = i
            p._hp_mapping = _Mapping(self, p.numel() - (1 if i == split else 0))  # split: part on another rank
            p.register_post_accumulate_grad_hook(self._take)
        self.base = torch.optim.SGD(self.bit16_groups[0], lr=0.1)
        self.stepped_with = None

    def _take(self, p: torch.Tensor) -> None:
        self.averaged_gradients[p._index_in_param_group] = p.grad.detach().flatten().clone()
        p.grad = None

    def step(self) -> None:
        grads = self.averaged_gradients
        self.stepped_with = {i: g * 0.5 for i, g in grads.items()}  # clipping
        self.averaged_gradients = None
        self.base.step()


class DeepSpeedEngine(nn.Module):
    """Named as DeepSpeed's engine: the model under ``module``, the ZeRO optimizer as ``optimizer``."""

    def __init__(self, model: nn.Module, split: int = -1) -> None:
        super().__init__()
        self.module = model
        self.optimizer = _ZeroOptimizer(model.parameters(), split)

    def forward(self, x):
        return self.module(x)


def _train(engine: DeepSpeedEngine, **options) -> tuple:
    sink = MemorySink()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    with precisiondiff.capture(model=engine, level="module", sink=sink, **options) as cap:
        engine(x).square().sum().backward()
        reference = {n: p.grad for n, p in engine.named_parameters()}  # None: the engine took them
        engine.optimizer.step()
        cap.step()
    return sink, reference


def test_zero_gradients_are_recorded_from_the_engine_before_it_clips_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    plain = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    plain.load_state_dict(model.state_dict())
    engine = DeepSpeedEngine(model)
    sink, during = _train(engine, mode="tensors")
    assert all(g is None for g in during.values())  # what makes the adapter needed
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    plain(x).square().sum().backward()
    recorded = {(e["scope"], r["slot"]): sink.tensor(r) for e in sink.events if e["kind"] == "param"
                for r in e["tensors"]}
    assert len(recorded) == 4
    for name, p in plain.named_parameters():
        scope, _, pname = f"module.{name}".rpartition(".")
        assert torch.equal(recorded[(scope, f"param_grad.{pname}")], p.grad), name  # unclipped, bitwise
    assert "step" not in engine.optimizer.__dict__  # the instance's step is restored after capture


def test_a_parameter_split_between_ranks_is_left_out():
    torch.manual_seed(0)
    engine = DeepSpeedEngine(nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)), split=0)
    sink, _ = _train(engine)
    slots = {(e["scope"], r["slot"]) for e in sink.events if e["kind"] == "param" for r in e["tensors"]}
    assert ("module.0", "param_grad.weight") not in slots and ("module.0", "param_grad.bias") in slots
    assert len(slots) == 3


def test_outside_the_engines_window_there_is_no_gradient():
    p = nn.Parameter(torch.ones(3))
    assert zero_gradient(p) is None  # not a ZeRO parameter
    engine = DeepSpeedEngine(nn.Linear(2, 1))
    engine.optimizer.averaged_gradients = None  # after the engine's step
    assert all(zero_gradient(q) is None for q in engine.parameters())


# -- optimizer events per parameter fragment ---------------------------------------------------------
class _FlatMapping:
    """``tensor_fragment`` of a parameter held whole: its slice of the flat fp32 partition."""

    def __init__(self, flat: torch.Tensor, start: int, numel: int) -> None:
        self.hp_fragment = flat.data.narrow(0, start, numel)
        self.hp_fragment_address = _Address(numel, start)
        self.lp_fragment_address = _Address(numel, 0)

    def get_lp_grad_fragment(self, index: int) -> torch.Tensor:
        raise ValueError("Gradients are only available immediately after backward and before engine step")


class _FlatZero:
    """ZeRO-1 on one rank in miniature: the parameters' fp32 copies concatenated into one flat
    partition, which the wrapped torch AdamW steps; the parameters are refreshed from it."""

    def __init__(self, params) -> None:
        self.bit16_groups = [list(params)]
        self.flat = nn.Parameter(torch.cat([p.detach().flatten() for p in self.bit16_groups[0]]))
        self.optimizer = torch.optim.AdamW([self.flat], lr=0.1, foreach=False)
        start = 0
        for i, p in enumerate(self.bit16_groups[0]):
            p._index_in_param_group, p._hp_mapping = i, _FlatMapping(self.flat, start, p.numel())
            start += p.numel()

    def step(self) -> None:
        self.flat.grad = torch.cat([p.grad.flatten() for p in self.bit16_groups[0]])
        self.optimizer.step()
        with torch.no_grad():
            for p in self.bit16_groups[0]:
                p.copy_(p._hp_mapping.hp_fragment.view(p.shape))


class _FlatEngine(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model
        self.optimizer = _FlatZero(list(model.parameters()))

    def forward(self, x):
        return self.module(x)


_FlatEngine.__name__ = "DeepSpeedEngine"  # what capture recognises the engine by


def test_optimizer_ops_on_a_flat_partition_are_recorded_per_parameter():
    """Each element-wise op of the wrapped AdamW on the flat partition is one event per parameter
    slice (capture/deepspeed.py fragment_slices), named by the parameter; the step counter's op,
    on the whole partition's state, keeps the partition's name."""
    torch.manual_seed(0)
    engine = _FlatEngine(nn.Linear(3, 2))
    sink = MemorySink()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    with precisiondiff.capture(model=engine, level="op", mode="tensors", sink=sink) as cap:
        engine(x).square().sum().backward()
        engine.optimizer.step()
        cap.step()
    updates = [e for e in sink.events if e["direction"] == "optimizer"]
    by_scope = {}
    for e in updates:
        by_scope.setdefault(e["scope"], []).append(e)
    assert set(by_scope) == {"optimizer.param_groups.0/module.weight", "optimizer.param_groups.0/module.bias",
                             "optimizer.param_groups.0/flat_partition"}, sorted(by_scope)
    weight_ops = [e["name"] for e in by_scope["optimizer.param_groups.0/module.weight"]]
    assert weight_ops == [e["name"] for e in by_scope["optimizer.param_groups.0/module.bias"]]
    assert "aten.addcdiv_.default" in weight_ops and "aten.lerp_.Scalar" in weight_ops
    # the state's creation (zeros_like of the partition) and the step counter's add_
    assert {e["name"] for e in by_scope["optimizer.param_groups.0/flat_partition"]} == \
        {"aten.zeros_like.default", "aten.add_.Tensor"}
    last = [e for e in by_scope["optimizer.param_groups.0/module.bias"] if e["name"] == "aten.addcdiv_.default"][-1]
    assert last["optimizer"]["fragment"] == {"start": 6, "numel": 2} and last["optimizer"]["param"] == "module.bias"
    out = next(r for r in last["tensors"] if r["slot"] == "output.0")
    assert torch.equal(sink.tensor(out), engine.optimizer.flat.detach()[6:8])  # the bias's slice, after the step
