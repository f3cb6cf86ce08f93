"""The CUDA path end to end: capture, compare and bisect with cuda/bf16 against cpu/float64.

Skipped cleanly where no GPU exists (CI has none); run on a GPU machine with `make test`.
"""
import pytest
import torch

from precisiondiff.runtime.targets import Target, default_dut

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_default_dut_is_cuda_bf16():
    assert str(default_dut()) == "cuda/bf16"


def test_capture_compare_bisect_on_cuda(tmp_path, buggy_spec):
    import precisiondiff
    from precisiondiff.capture.runner import capture_workload
    capture_workload(buggy_spec, tmp_path / "dut", target="cuda/bf16", mode="tensors")
    capture_workload(buggy_spec, tmp_path / "ref", target="cpu/float64", mode="tensors")
    dump = precisiondiff.load(tmp_path / "dut")
    devices = {e.device.split(":")[0] for e in dump.events() if e.kind == "op"}
    assert devices == {"cuda"}, devices  # an op that fell back to the CPU would show here
    result = precisiondiff.compare(tmp_path / "dut", tmp_path / "ref")
    assert result.summary["tensors"] > 100
    found = precisiondiff.bisect(buggy_spec, target="cuda/bf16")
    assert found.verdict == "kernel"
    assert (found.culprit["scope"], found.culprit["name"]) == ("blocks.0.norm1", "pdexample.fused_rms_norm.default")


def test_statistics_on_the_device_match_the_cpu():
    from precisiondiff.capture.stats import StatsBatch
    t = torch.randn(1000, 33)
    cpu, gpu = StatsBatch(), StatsBatch()
    h1, h2 = cpu.add(t), gpu.add(t.cuda())
    cpu.resolve(); gpu.resolve()
    a, b = cpu.get(h1), gpu.get(h2)
    assert a["fingerprint"] == b["fingerprint"]
    assert a["norm"] == pytest.approx(b["norm"], rel=1e-5)
    assert Target.parse("cuda:0/fp16").is_available()
