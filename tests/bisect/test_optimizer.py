"""Bisect of training workloads: optimizer updates judged by the peer rule, every step in order."""
from __future__ import annotations

import pytest
import torch

import precisiondiff
from precisiondiff.bisect import bisect_dump
from precisiondiff.capture.runner import capture_workload

from . import planted_optim as P

VENDOR = "pdtest.vendor_adamw_.default"


def _optimizer_units(result):
    units = ([result.culprit] if result.culprit else []) + list(result.candidates)
    return [u for u in units if u["direction"] == "optimizer"]


@pytest.mark.parametrize("bug", ["moment", "bias", "decay"])
def test_planted_vendor_adamw_is_named_at_the_first_step(bug):
    r = precisiondiff.bisect(lambda: P.vendor(bug), target="cpu/bf16")
    assert r.verdict == "kernel"
    c = r.culprit
    assert (c["kind"], c["name"], c["direction"], c["step"]) == ("op", VENDOR, "optimizer", 0)
    # the first parameter the optimizer updates: its slice of the fused call
    assert c["scope"] == "optimizer.param_groups.0/fc1.weight"
    assert not c["peer"]["passed"] and c["peer"]["ratio"] > 100
    assert r.steps == [{"step": 0, "units_isolated": r.steps[0]["units_isolated"], "culprit": True}]
    # the forward and backward before it were judged and passed
    assert r.evidence["upstream_units"] > 0 and r.evidence["upstream_passed"] == r.evidence["upstream_units"]


def test_clean_vendor_adamw_is_not_blamed():
    r = precisiondiff.bisect(P.vendor_clean, target="cpu/bf16")
    assert r.verdict in ("parity", "accumulated")
    assert r.culprit is None and not _optimizer_units(r)
    assert [s["step"] for s in r.steps] == [0, 1]  # both steps judged
    assert r.final_error is not None and "params" in r.confirmation["detail_before"]


@pytest.mark.parametrize("workload", [P.stock_adamw_fused, P.stock_adamw_foreach, P.stock_sgd_foreach])
def test_stock_optimizers_are_not_blamed(workload):
    # the documented stock finding (the in-place bf16 foreach multiply rounds its scalar to bf16:
    # docs/bisect.md) is accepted, so any other optimizer blame shows; accepting it costs nothing
    # on a CPU that computes it otherwise
    accept = ["aten._foreach_mul_.Scalar"]
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":  # the portable add with alpha (docs/bisect.md)
        accept.append("aten._foreach_add.List")
    r = precisiondiff.bisect(workload, target="cpu/bf16", accept=accept)
    assert not _optimizer_units(r), r.culprit
    assert [s["step"] for s in r.steps][:1] == [0]


def test_a_bug_from_the_second_step_is_named_there():
    r = precisiondiff.bisect(lambda: P.vendor("late"), target="cpu/bf16")
    assert r.verdict == "kernel"
    assert (r.culprit["name"], r.culprit["direction"], r.culprit["step"]) == (VENDOR, "optimizer", 1)
    assert [(s["step"], s["culprit"]) for s in r.steps] == [(0, False), (1, True)]


def test_offline_dump_of_several_steps(tmp_path):
    out = tmp_path / "dut"
    capture_workload("tests/bisect/planted_optim.py:vendor_moment", out, target="cpu/bf16", mode="replay")
    r = bisect_dump(out, workload="tests/bisect/planted_optim.py:vendor_moment")
    assert r.verdict == "kernel"
    assert (r.culprit["name"], r.culprit["direction"], r.culprit["step"]) == (VENDOR, "optimizer", 0)
    assert r.culprit["scope"].startswith("optimizer.param_groups.0/")


def test_direction_optimizer_only():
    r = precisiondiff.bisect(lambda: P.vendor("bias"), target="cpu/bf16", direction="optimizer")
    everything = precisiondiff.bisect(lambda: P.vendor("bias"), target="cpu/bf16")
    assert r.culprit["direction"] == "optimizer" and r.culprit["name"] == everything.culprit["name"]
    # only the update's ops before it (state creation, step counters), not the forward and backward
    assert 0 < r.evidence["upstream_units"] < everything.evidence["upstream_units"]


def test_training_workload_needs_a_loss():
    with pytest.raises(precisiondiff.errors.WorkloadError, match="needs a loss"):
        precisiondiff.bisect(lambda: precisiondiff.Workload(torch.nn.Linear(2, 2), torch.randn(1, 2),
                                                            optimizer=torch.optim.SGD), target="cpu/bf16")


def test_grad_scaler_ops_are_judged_too():
    r = precisiondiff.bisect(P.scaled_adamw, target="cpu/bf16+autocast")
    assert not r.unreplayable  # _amp_* ops replay with their float32 scalars kept
    assert not _optimizer_units(r)
    assert [s["step"] for s in r.steps] == [0, 1]
