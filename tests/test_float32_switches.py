"""TF32 switches: recorded by capture, and a float32 DUT's bisect says which were on."""
from __future__ import annotations

import pytest
import torch

import precisiondiff
from precisiondiff.runtime.float32_switches import float32_switches, tf32_notes
from precisiondiff.runtime.targets import Target


@pytest.fixture
def tf32_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_the_switches_are_read_as_the_process_has_them(tf32_matmuls):
    switches = float32_switches()
    assert switches["cuda.matmul.allow_tf32"] is True
    assert switches["cudnn.allow_tf32"] is torch.backends.cudnn.allow_tf32
    assert "mlu.matmul.allow_tf32" not in switches  # no torch_mlu here: not a switch this process has
    torch.backends.cuda.matmul.allow_tf32 = False
    assert float32_switches()["cuda.matmul.allow_tf32"] is False


@pytest.mark.parametrize("dut,switches,says", [
    ("cuda/float32", {"cuda.matmul.allow_tf32": True, "cudnn.allow_tf32": False}, ["cuda matmuls"]),
    ("cuda:1/float32", {"cuda.matmul.allow_tf32": True, "cudnn.allow_tf32": True}, ["cuda matmuls", "cuda convolutions"]),
    ("cuda/float32", {"cuda.matmul.allow_tf32": False, "cudnn.allow_tf32": False}, []),
    ("mlu/float32", {"mlu.matmul.allow_tf32": False, "cnnl.allow_tf32": True}, ["mlu convolutions"]),
    ("cuda/bf16", {"cuda.matmul.allow_tf32": True}, []),  # bf16 matmuls: TF32 does not apply
    ("cuda/bf16+autocast", {"cuda.matmul.allow_tf32": True}, []),
    ("cpu/float32", {"cuda.matmul.allow_tf32": True}, []),
    ("mlu/float32", {"cuda.matmul.allow_tf32": True}, []),  # another device's switch
    ("cuda/float32", None, []),  # a dump from before the switches were recorded
])
def test_a_float32_dut_is_told_which_tf32_switches_were_on(dut, switches, says):
    notes = tf32_notes(Target.parse(dut), switches)
    assert [n.split("TF32 was on for ")[1].split(" (")[0] for n in notes] == says


def test_capture_records_the_switches(tmp_path, tf32_matmuls):
    model = torch.nn.Linear(4, 2)
    with precisiondiff.capture(tmp_path / "d", model=model):
        model(torch.randn(3, 4))
    assert precisiondiff.load(tmp_path / "d").meta["float32_switches"]["cuda.matmul.allow_tf32"] is True
