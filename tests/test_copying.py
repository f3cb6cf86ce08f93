"""Moving a model that holds objects deepcopy cannot copy (process groups, locks) to a target:
they are shared with the copy, everything else is copied (precisiondiff/runtime/copying.py)."""
from __future__ import annotations

import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

from precisiondiff.errors import WorkloadError
from precisiondiff.runtime.copying import copy_model
from precisiondiff.runtime.targets import Target
from tests.conftest import pd_cli
from tests.distributed.conftest import free_port


class _Config:
    """A framework's config object that holds the groups (Megatron's ProcessGroupCollection)."""

    def __init__(self, group, lock):
        self.tp_group, self.lock, self.sizes = group, lock, [2, 3]


class RowParallel(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.config = _Config(group, threading.Lock())
        self.groups = {"tp": group}

    def forward(self, x):
        y = self.linear(x)
        dist.all_reduce(y, group=self.config.tp_group)
        return y


@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def test_process_groups_and_locks_are_shared_and_the_rest_copied(group):
    model = torch.nn.Sequential(RowParallel(group), torch.nn.ReLU())
    with pytest.raises(TypeError, match="cannot pickle"):
        __import__("copy").deepcopy(model)
    moved = Target.parse("cpu/float64").prepare_model(model)
    inner, orig = moved[0], model[0]
    assert inner.config.tp_group is group and inner.groups["tp"] is group
    assert inner.config.lock is orig.config.lock
    assert inner.config is not orig.config and inner.config.sizes == [2, 3]
    assert inner.config.sizes is not orig.config.sizes
    assert inner.linear.weight.dtype == torch.float64 and orig.linear.weight.dtype == torch.float32
    assert torch.equal(inner.linear.weight, orig.linear.weight.double())
    x = torch.randn(2, 4, dtype=torch.float64)
    assert torch.allclose(moved(x), model(x.float()).double(), atol=1e-6)


def test_the_attributes_a_framework_sets_on_parameters_are_kept(group):
    model = torch.nn.Sequential(RowParallel(group), torch.nn.Linear(3, 2))
    weight = model[0].linear.weight
    weight.tensor_model_parallel, weight.partition_dim, weight.groups = True, 0, [group]  # Megatron's
    for source in (model, torch.nn.Sequential(torch.nn.Linear(3, 2))):  # the sharing copy, the plain one
        source[-1].weight.sequence_parallel = True
        moved = Target.parse("cpu/float64").prepare_model(source)
        assert moved[-1].weight.sequence_parallel is True
    moved = Target.parse("cpu/float64").prepare_model(model)
    copied = moved[0].linear.weight
    assert (copied.tensor_model_parallel, copied.partition_dim, copied.groups[0]) == (True, 0, group)
    assert copied.groups is not weight.groups and copied is not weight
    plain = torch.nn.Linear(2, 2)
    plain.weight.lock = threading.Lock()  # an attribute deepcopy cannot copy: shared, not a refusal
    assert copy_model(plain).weight.lock is plain.weight.lock


class _Uncopyable(torch.Tensor):
    def __deepcopy__(self, memo):
        raise TypeError("this tensor cannot be copied")


def test_a_model_that_cannot_be_copied_at_all_is_one_line():
    model = torch.nn.Linear(2, 2)
    model.register_buffer("odd", torch.zeros(2).as_subclass(_Uncopyable))
    with pytest.raises(WorkloadError, match="cannot copy the model for the target: copy.deepcopy raised TypeError"):
        copy_model(model)


WORKLOAD = '''
import os, torch, torch.distributed as dist, precisiondiff
from torch import nn

class RowParallel(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.linear, self.group = nn.Linear(8, 8), group
    def forward(self, x):
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y

def build():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PD_PORT"], rank=0, world_size=1)
    model = nn.Sequential(RowParallel(dist.new_group([0])), nn.GELU(), nn.Linear(8, 2))
    return precisiondiff.Workload(model, torch.randn(4, 8), loss=lambda o: o.square().mean())

class Odd(torch.Tensor):
    def __deepcopy__(self, memo):
        raise TypeError("cannot pickle 'Odd' object")

def odd():
    model = nn.Linear(2, 2)
    model.register_buffer("odd", torch.zeros(2).as_subclass(Odd))
    return precisiondiff.Workload(model, torch.randn(3, 2))
'''


def test_a_workload_holding_a_process_group_is_captured(tmp_path):
    (tmp_path / "wl.py").write_text(textwrap.dedent(WORKLOAD))
    r = pd_cli("capture", "wl.py:build", "-o", "dut", "--target", "cpu/bf16", cwd=str(tmp_path),
               env={"PD_PORT": str(free_port())})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "captured" in r.stdout and "Traceback" not in r.stderr
    r = pd_cli("capture", "wl.py:odd", "-o", "odd", cwd=str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot copy the model" in r.stderr
