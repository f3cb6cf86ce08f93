"""On a GPU: the cuda/fp32 card with TF32 matmuls on and off differs in the input rounding line.

Skipped cleanly where no GPU exists (CI has none); run on a GPU machine with `make test`.
"""
from __future__ import annotations

import pytest
import torch

from precisiondiff.probe import diff_rows, probe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.fixture
def tf32_setting():
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_tf32_shows_as_11_input_bits_and_the_same_accumulator_width(tf32_setting):
    torch.backends.cuda.matmul.allow_tf32 = False
    off = probe("cuda/fp32", ["gemm"])
    torch.backends.cuda.matmul.allow_tf32 = True
    on = probe("cuda/fp32", ["gemm"])
    assert off.get("gemm", "input_bits") == 24
    assert on.get("gemm", "input_bits") == 11
    differ = {prop for op, prop, _, _, d in diff_rows(off, on) if d}
    # crafted accumulator inputs are powers of two or two-bit numbers, exact in TF32: the accumulator's
    # width is the same. Its order, rounding, extra bits and subnormal handling may change with the kernel
    # (on an H200, 2026-12-04, all four did: TF32 runs on the tensor cores, fp32 does not)
    assert not differ & {"accumulator_bits", "long_sum_bits"}
    assert "input_bits" in differ
