"""The stand-in accelerator itself: a device PyTorch treats as ``mlu``, whose kernels are the CPU's.

Without planted numerics every kernel is the CPU's ATen kernel run on device memory, so a model on
``mlu`` in bf16 gives bitwise the CPU's bf16 results; that is what makes a planted defect the only
difference precisiondiff has to find.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from examples.tiny_transformer import build


def _run(model, wl, device, *, autocast=False):
    m = copy.deepcopy(model).to(device) if autocast else copy.deepcopy(model).to(device, torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = m(wl.inputs.to(device))
        loss = wl.loss(out)
    loss.backward()
    return out.float().cpu(), [p.grad.float().cpu() for p in m.parameters()]


def test_registered_as_mlu_through_pytorch_generic_paths():
    assert torch.device("mlu").type == "mlu"
    assert torch.get_device_module("mlu") is torch.mlu
    assert torch.accelerator.current_accelerator().type == "mlu"
    assert torch.mlu.is_available() and torch.mlu.device_count() >= 1
    assert torch.amp.is_autocast_available("mlu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_host_device_round_trip_is_exact(dtype):
    x = (torch.randn(7, 5) * 100).to(dtype)
    d = x.to("mlu")
    assert d.device.type == "mlu" and d.is_mlu
    back = d.cpu()
    assert back.dtype == dtype and torch.equal(back, x)


def test_device_index_and_guard(standin):  # the stand-in has two devices
    assert torch.mlu.device_count() == 2
    x = torch.ones(3, device="mlu:1")
    assert (x + 1).device == torch.device("mlu:1")
    with torch.mlu.device(1):
        assert torch.mlu.current_device() == 1
        assert torch.empty(2, device="mlu").device == torch.device("mlu:1")
    assert torch.mlu.current_device() == 0


def test_views_and_in_place_ops_share_device_memory():
    x = torch.zeros(3, 4, device="mlu")
    x.t()[1].add_(5)  # a view of a view, written in place
    assert torch.equal(x.cpu()[:, 1], torch.full((3,), 5.0))
    y = torch.empty(0, device="mlu")
    torch.add(torch.ones(2, 3, device="mlu"), 1, out=y)  # out= resizes the device tensor
    assert y.shape == (2, 3) and torch.equal(y.cpu(), torch.full((2, 3), 2.0))


def test_pinned_host_memory_for_non_blocking_read_back():
    host = torch.empty(4, pin_memory=True)
    assert host.is_pinned()
    host.copy_(torch.arange(4.0, device="mlu"), non_blocking=True)
    torch.mlu.synchronize()
    assert torch.equal(host, torch.arange(4.0))


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "bf16+autocast"])
def test_training_step_matches_the_cpu_bitwise(standin, autocast):
    wl = build()
    out_cpu, grads_cpu = _run(wl.model, wl, "cpu", autocast=autocast)
    out_mlu, grads_mlu = _run(wl.model, wl, "mlu", autocast=autocast)
    assert torch.equal(out_cpu, out_mlu)
    assert all(torch.equal(a, b) for a, b in zip(grads_cpu, grads_mlu))


def test_autocast_on_the_device_casts_matmuls_and_keeps_fp32_ops():
    a = torch.randn(4, 8, device="mlu")
    with torch.autocast("mlu", dtype=torch.bfloat16):
        assert (a @ a.t()).dtype == torch.bfloat16
        assert torch.exp(a.bfloat16()).dtype == torch.float32


def test_unimplemented_ops_fall_back_to_the_cpu_silently(standin):
    x = torch.randn(8, device="mlu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = torch.nn.functional.gelu(x)
    assert y.device.type == "mlu"
    assert torch.equal(y.cpu(), torch.nn.functional.gelu(x.cpu()))
    assert standin.fallback_counts() == {"aten::gelu.out": 1}
    torch.relu(x)
    assert "aten::relu" not in standin.fallback_counts()


def test_the_unimplemented_set_is_configurable_and_can_warn(standin):
    standin.set_unimplemented(["aten::relu"])
    standin.plant(warn=True)
    x = torch.randn(8, device="mlu")
    with pytest.warns(UserWarning, match="'aten::relu' is not implemented on the device"):
        torch.relu(x)
    torch.nn.functional.gelu(x)
    assert set(standin.fallback_counts()) == {"aten::relu"}
    with pytest.raises(ValueError, match="no_such_op"):
        standin.set_unimplemented(["aten::no_such_op"])


def test_planted_gemm_accumulates_in_bf16(standin):
    torch.manual_seed(0)
    a, b = torch.randn(16, 512).bfloat16(), torch.randn(512, 16).bfloat16()
    exact = a.double() @ b.double()
    cpu_err = (torch.mm(a, b).double() - exact).abs().max()
    standin.plant(gemm_chunk=1)
    dev_err = (torch.mm(a.to("mlu"), b.to("mlu")).cpu().double() - exact).abs().max()
    assert dev_err > 4 * cpu_err
    # fp32 GEMMs are untouched
    assert torch.equal(torch.mm(a.float().to("mlu"), b.float().to("mlu")).cpu(), torch.mm(a.float(), b.float()))


def test_planted_cast_truncates_fp32_to_bf16_on_the_device(standin):
    torch.manual_seed(0)
    x = torch.randn(1000)
    x[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    standin.plant(truncate_cast=True)
    got = x.to("mlu").to(torch.bfloat16).cpu()
    # oracle: the 16 high bits of the fp32 pattern
    want = (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(got[3:].view(torch.int16), want[3:].view(torch.int16))
    assert got[0].isnan() and got[1] == float("inf") and str(got[2].item()) == "-0.0"
    assert not torch.equal(got, x.to(torch.bfloat16))  # round-to-nearest differs
    # host-to-device conversion happens on the host, correctly rounded
    assert torch.equal(x.to("mlu", torch.bfloat16).cpu().view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_planted_flush_to_zero_on_device_kernels_only(standin):
    x = torch.tensor([1e-39, 1.0, -2e-39], device="mlu")
    standin.plant(ftz=True)
    assert torch.equal((x * 1.0).cpu(), torch.tensor([0.0, 1.0, 0.0]))
    # gelu runs through the CPU fallback, which does not flush
    assert torch.nn.functional.gelu(x).cpu()[0] != 0


def test_read_back_traffic_is_counted(standin):
    before = standin.to_host_traffic()
    torch.ones(100, device="mlu").cpu()
    torch.ones(1, device="mlu").item()
    nbytes, copies = standin.to_host_traffic()
    assert (nbytes - before[0], copies - before[1]) == (404, 2)


def test_capture_asks_the_dispatcher_where_an_op_ran(standin):
    from precisiondiff.capture.ran_on import ran_on

    aten = torch.ops.aten
    assert ran_on(aten.gelu.default, "mlu:0") == "cpu"  # structured: runs through gelu.out, a fallback
    assert ran_on(aten.gelu_backward.default, "mlu:0") == "cpu"
    assert ran_on(aten.addmm.default, "mlu:0") == "mlu:0"
    assert ran_on(aten._to_copy.default, "mlu:0") == "mlu:0"  # composite: its parts run on the device
    standin.set_unimplemented(["aten::relu"])
    assert (ran_on(aten.relu.default, "mlu:1"), ran_on(aten.gelu.default, "mlu:1")) == ("cpu", "mlu:1")
