"""Custom and fused ops probed once their family and inputs are registered."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.errors import PrecisionDiffError
from precisiondiff.probe import probe, register_op, registered_ops, unregister_op

from . import planted  # noqa: F401  (registers the pdprobe_test ops)

OPS = torch.ops.pdprobe_test


def rms_inputs(x):
    return x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), 1e-6


@pytest.fixture
def registered():
    names = []

    def register(name, *args, **kwargs):
        names.append(name)
        return register_op(name, *args, **kwargs)

    yield register
    for name in names:
        unregister_op(name)


def test_a_fused_norm_is_probed_as_its_family(registered):
    registered("fused_rms", "rms_norm", OPS.fused_rms_norm, build=rms_inputs)
    registered("sloppy_rms", "rms_norm", OPS.sloppy_rms_norm, build=rms_inputs)
    card = probe("cpu/bf16", ["fused_rms", "sloppy_rms"])
    assert card.ops() == ["fused_rms", "sloppy_rms"]
    assert card.finding("fused_rms", "max_ulp").family == "rms_norm"
    assert card.get("fused_rms", "max_ulp") <= 0.51  # computed in float64, rounded once
    assert card.get("sloppy_rms", "max_ulp") > 2  # squares summed in bfloat16
    assert card.get("fused_rms", "deterministic") is True
    assert card.meta.get("kernels") is None  # the stock kernels, the custom ops named as ops


def test_output_selects_the_result_of_a_multi_output_op(registered):
    def mm_and_norm(a, b):
        return torch.ops.pdprobe_test.trunc14_mm(a, b), a.norm()

    registered("mm_pair", "gemm", mm_and_norm, output=lambda out: out[0])
    card = probe("cpu/fp32", ["mm_pair"])
    assert card.get("mm_pair", "accumulator_bits") == 14
    assert card.get("mm_pair", "rounding") == "toward-zero"


def test_registration_errors_are_one_line(registered):
    with pytest.raises(PrecisionDiffError, match="unknown op family 'rmsnorm'"):
        register_op("x", "rmsnorm", torch.mm)
    with pytest.raises(PrecisionDiffError, match="is a family name"):
        register_op("gemm", "gemm", torch.mm)
    with pytest.raises(PrecisionDiffError, match="unknown op 'nope' in --ops"):
        probe("cpu/bf16", ["nope"])
    assert "x" not in registered_ops()


def test_conv_backward_kernels_come_from_conv():
    from precisiondiff.probe import Kernels
    with pytest.raises(PrecisionDiffError, match="conv_bwd_input is measured through conv's autograd"):
        Kernels.stock("cpu", torch.float32).replace(conv_bwd_input=torch.nn.functional.conv1d)
    with pytest.raises(PrecisionDiffError, match="unknown op family 'conv_bwd_weight'"):
        register_op("my_conv_bwd", "conv_bwd_weight", torch.nn.functional.conv1d)
