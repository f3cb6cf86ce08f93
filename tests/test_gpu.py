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


class _SideStreamNet(torch.nn.Module):
    """Linear layers run on a side stream that lags far behind the host (a ~25 ms sleep kernel
    first): a statistic or host copy queued on the wrong stream would read memory before the
    layer's kernel wrote it, or after the allocator handed it on."""

    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            for layer in self.layers:
                x = torch.relu(layer(x))
            out = x * 2.0
            del x
            # memory freed on the side stream, taken again at once and overwritten there
            scratch = [torch.full((1024, 1024), float("nan"), device="cuda") for _ in range(8)]
            del scratch
        main.wait_stream(side)
        out.record_stream(main)
        return out


def _plain_layer_outputs(model, x):
    """Each layer's output from a run without capture (cloned on the stream it ran on)."""
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, name=f"layers.{k}": outs.__setitem__(name, o.clone()))
             for k, layer in enumerate(model.layers)]
    model(x)
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    return {name: t.cpu() for name, t in outs.items()}


@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_capture_on_a_lagging_side_stream_records_what_the_kernels_wrote(tmp_path, mode):
    import precisiondiff
    from precisiondiff.capture.stats import StatsBatch
    torch.manual_seed(0)
    model = _SideStreamNet().cuda()
    x = torch.randn(512, 1024, device="cuda")
    expected = _plain_layer_outputs(model, x)
    with precisiondiff.capture(tmp_path / "d", model=model, level="all", mode=mode):
        model(x)
    dump = precisiondiff.load(tmp_path / "d")
    seen = set()
    for ev in dump.events(kind="module", direction="forward"):
        if ev.scope not in expected:
            continue
        rec = next(t for t in ev.tensors if t.slot == "output.0")
        if mode == "tensors":
            assert torch.equal(dump.tensor(rec.key), expected[ev.scope]), ev.scope
        else:
            batch = StatsBatch()
            handle = batch.add(expected[ev.scope])
            batch.resolve()
            assert rec.stats["fingerprint"] == batch.get(handle)["fingerprint"], ev.scope
            assert rec.stats["norm"] == pytest.approx(batch.get(handle)["norm"], rel=1e-5), ev.scope
        seen.add(ev.scope)
    assert seen == set(expected)


# Seen on an H200 (torch 2.11.0+cu130, 2026-12-04): with TF32 off the peer rule still blames a stock float32
# kernel, aten._log_softmax_backward_data: 8 of 4096 elements beyond the CPU peers' worst + 0.5 ULP (1.59 ULP
# against 0.91; CUDA documents its expf at 2 ULP). Open: docs/bisect.md, "On a GPU".
_PEERS_ON_A_GPU = pytest.mark.xfail(strict=True, reason="the peer rule blames CUDA's float32 log_softmax "
                                    "backward (docs/bisect.md, 'On a GPU')")


@pytest.mark.parametrize("tf32", [pytest.param(False, marks=_PEERS_ON_A_GPU), True])
def test_float32_bisect_names_a_matmul_only_when_tf32_is_on(example_spec, tf32):
    """cuda/float32 against cpu/float64: TF32 rounds a matmul's inputs to 11 bits, far past what a
    float32 kernel may err; with it off the stock float32 kernels are within their budgets."""
    import precisiondiff
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        found = precisiondiff.bisect(example_spec, target="cuda/float32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    if tf32:
        assert found.verdict == "kernel", found.notes
        assert any(k in found.culprit["name"] for k in ("mm", "linear", "matmul")), found.culprit
        assert any("TF32 was on for cuda matmuls" in n for n in found.notes), found.notes
    else:
        assert found.verdict != "kernel", found.culprit
