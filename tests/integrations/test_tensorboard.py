"""report --tensorboard: per-layer error over training steps, read back with TensorBoard's own
EventAccumulator."""
from __future__ import annotations

import sys

import pytest
import torch

import precisiondiff
from precisiondiff.errors import PrecisionDiffError
from precisiondiff.report.tensorboard import write_tensorboard
from precisiondiff.store import DumpWriter, tensor_key

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from click.testing import CliRunner  # noqa: E402

from precisiondiff.cli import cli  # noqa: E402

STEPS = 4
LAYERS = ("embed", "blocks.0", "head")


def _stats(t: torch.Tensor) -> dict:
    f = t.double()
    return {"min": f.min().item(), "max": f.max().item(), "mean": f.mean().item(),
            "abs_mean": f.abs().mean().item(), "norm": f.norm().item(), "nan": 0, "inf": 0}


def _write(path, target: str, dtype: torch.dtype, drift: float) -> str:
    """A 4-step dump: three layers; on the DUT (drift > 0) the output of blocks.0 is off by
    drift * (step + 1) relative, so its error grows over the steps."""
    gen = torch.Generator().manual_seed(0)
    with DumpWriter(path, meta={"target": target, "level": "module", "mode": "tensors", "multi_step": True,
                                "steps": STEPS}) as w:
        seq = 0
        for step in range(STEPS):
            for layer in LAYERS:
                golden = torch.randn(64, generator=gen, dtype=torch.float64)
                value = golden * (1 + drift * (step + 1)) if layer == "blocks.0" else golden
                t = value.to(dtype)
                key = tensor_key(layer, "Linear", 0, "forward", "output.0", step=step, multi_step=True)
                rec = {"key": key, "slot": "output.0", "dtype": str(dtype).replace("torch.", ""),
                       "shape": [64], "stats": _stats(t), "data_key": key}
                w.write_event({"seq": seq, "step": step, "kind": "module", "scope": layer, "name": "Linear",
                               "direction": "forward", "call": 0, "device": "cpu", "tensors": [rec]}, {key: t})
                seq += 1
    return str(path)


@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    return _write(root / "dut", "cpu/bf16", torch.bfloat16, 0.01), _write(root / "ref", "cpu/float64", torch.float64, 0.0)


def _accumulator(logdir) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    return ea


def test_per_layer_error_over_steps_reads_back_as_scalars(drifting, tmp_path):
    c = precisiondiff.compare(*drifting)
    counts = write_tensorboard(c, tmp_path / "tb")
    assert counts["steps"] == STEPS and counts["layers"] == len(LAYERS) and counts["histograms"] == STEPS * len(LAYERS)
    ea = _accumulator(tmp_path / "tb")
    tags = ea.Tags()
    assert {f"error/forward/{layer}" for layer in LAYERS} <= set(tags["scalars"])
    drift = ea.Scalars("error/forward/blocks.0")
    assert [e.step for e in drift] == list(range(STEPS))
    expected = {r.step: r.error for r in c.rows if r.scope == "blocks.0"}
    assert [e.value for e in drift] == pytest.approx([expected[s] for s in range(STEPS)], rel=1e-6)
    assert [round(e.value, 2) for e in drift] == [0.01, 0.02, 0.03, 0.04]  # the planted drift
    steady = [e.value for e in ea.Scalars("error/forward/embed")]
    assert max(steady) < 2.0 ** -8  # only bf16 rounding
    assert [e.value for e in ea.Scalars("summary/max_error")] == pytest.approx([e.value for e in drift], rel=1e-6)


def test_ulp_histograms_count_every_element(drifting, tmp_path):
    write_tensorboard(precisiondiff.compare(*drifting), tmp_path / "tb")
    ea = _accumulator(tmp_path / "tb")
    hists = ea.Histograms("ulp/forward/blocks.0")
    assert [h.step for h in hists] == list(range(STEPS))
    assert all(h.histogram_value.num == 64 for h in hists)
    assert hists[-1].histogram_value.max > hists[0].histogram_value.max  # ULP error grows with the drift
    assert ea.Histograms("ulp/forward/embed")[0].histogram_value.max <= 0.5 + 1e-9  # correctly rounded


def test_report_cli_writes_tensorboard_without_html(drifting, tmp_path):
    r = CliRunner().invoke(cli, ["report", *drifting, "--tensorboard", str(tmp_path / "tb"), "--no-progress"])
    assert r.exit_code == 1, r.output  # blocks.0 diverges
    assert f"over {STEPS} steps to {tmp_path / 'tb'}" in r.stderr
    assert "error/forward/blocks.0" in _accumulator(tmp_path / "tb").Tags()["scalars"]
    usage = CliRunner().invoke(cli, ["report", *drifting])
    assert usage.exit_code == 2 and "needs -o FILE.html, --tensorboard DIR or --model-explorer" in usage.stderr


def test_without_tensorboard_the_error_says_how_to_install_it(drifting, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(PrecisionDiffError, match=r"pip install 'precisiondiff\[tensorboard\]'"):
        write_tensorboard(precisiondiff.compare(*drifting), tmp_path / "tb")
