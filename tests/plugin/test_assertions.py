"""precisiondiff.testing.assert_parity / assert_op_parity: the fixture's logic without pytest."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from precisiondiff.errors import PrecisionDiffError
from precisiondiff.testing.parity import check_op
from precisiondiff.strategies import op_inputs, parity_settings
from precisiondiff.testing import assert_op_parity


def _off_in_bf16(x):
    return x * 1.03 if x.dtype == torch.bfloat16 else x


def test_op_failure_message_is_the_one_format():
    with pytest.raises(AssertionError) as info:
        assert_op_parity(_off_in_bf16, torch.linspace(1, 2, 8), target="cpu/bf16", max_ulp=1)
    text = str(info.value)
    assert text.splitlines()[0].startswith("parity FAILED: ") and "on cpu/bf16 vs cpu/float64" in text
    assert "output: 8 of 8 elements (100%) exceed the bfloat16 unknown budget." in text
    assert "Worst at index (" in text and "Hint: " in text and "culprit" not in text


def test_unknown_budget_is_refused():
    with pytest.raises(PrecisionDiffError, match="unknown budget max_ulps"):
        assert_op_parity(torch.exp, torch.randn(4), target="cpu/bf16", max_ulps=1)


@parity_settings(max_examples=25)
@given(inp=op_inputs(torch.ops.aten.gelu.default, dtype=torch.bfloat16, elements=st.floats(-3, 1e4, width=32)))
def test_bf16_gelu_is_within_one_ulp_of_float64_above_minus_3(inp):
    # below -3 the stock CPU kernel's fp32 1+erf cancels (docs/pytest.md): a known finding.
    # Subnormal results may be flushed to zero by the CPU's fp32->bf16 conversion instruction
    # (AVX512-BF16 VCVTNEPS2BF16 flushes denormals; docs/pytest.md): hardware-dependent, excluded.
    x = inp.args[0].double()
    assume(not bool(((x != 0) & (x.abs() < 2.0 ** -124)).any()))
    assert_op_parity(torch.ops.aten.gelu.default, *inp.args, kwargs=inp.kwargs, target="cpu/bf16", max_ulp=1)


def _gelu_in_own_dtype(x):
    """GELU as the textbook formula, evaluated in the input's dtype: ``1 + erf(x/sqrt 2)`` cancels
    to 0 for x < -4 in bf16 (erf rounds to -1 exactly on every CPU), where float64 keeps 1e-12."""
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))


def test_a_cancelling_kernel_is_reported_with_its_worst_element():
    # the stock CPU gelu cancels the same way below -3 (docs/pytest.md, seen on AVX512 and
    # AVX2); the test plants the formula instead of pinning a stock kernel's vector path
    with pytest.raises(AssertionError, match=r"actual -0.0, golden -7.19\d*e-12: .* ULP"):
        assert_op_parity(_gelu_in_own_dtype, torch.tensor([-7.03125]), target="cpu/bf16", max_ulp=1)


@parity_settings(max_examples=25)
@given(inp=op_inputs(torch.ops.aten.gelu.default, dtype=torch.bfloat16))
def test_bf16_gelu_special_values_never_mismatch_nan_or_inf(inp):
    x = inp.args[0]
    # finite inputs above ~1.7e38 overflow inside the stock kernel (pinned below); gelu(+inf) is
    # NaN in its vectorized path (float64 gives inf; the scalar path differs): docs/pytest.md
    assume(not bool((x.isfinite() & (x.double().abs() > 1.6e38)).any()))
    assume(not bool((x == float("inf")).any()))
    r = check_op(
        torch.ops.aten.gelu.default, *inp.args, kwargs=inp.kwargs, target="cpu/bf16", max_ulp=1)
    assert r.checks[0].metrics["nan_mismatch"] == 0 and r.checks[0].metrics["inf_mismatch"] == 0


def _gelu_overflowing_in_bf16(x):
    """A planted GELU: its bf16 path forms x * (1 + erf(x / sqrt 2)) in bf16 before halving, so
    for |x| >= 2**127 the product overflows where the float64 result is finite."""
    if x.dtype == torch.bfloat16:
        return (x * (1 + torch.erf(x * 0.7071067811865476))) * 0.5
    return (0.5 * x) * (1 + torch.erf(x * 0.7071067811865476))  # halves first: no overflow


def test_bf16_gelu_overflow_near_max_is_caught_by_default():
    r = check_op(_gelu_overflowing_in_bf16, torch.tensor([1.7014e38, 1e38, 1.0], dtype=torch.bfloat16),
                 target="cpu/bf16")
    assert not r.passed and r.checks[0].metrics["inf_mismatch"] >= 1
    assert "NaN/Inf where the golden and every peer differ" in r.checks[0].message


def test_stock_bf16_gelu_passes_the_default_rule_over_its_range():
    """The peer rule (docs/comparators.md): the stock kernel's -0.0 at gelu(-7) (7e-12 in
    float64) is what float32 arithmetic rounded once gives too, and is nothing at the scale of
    the tensor."""
    assert check_op(torch.nn.functional.gelu, torch.linspace(-10, 10, 1000), target="cpu/bf16").passed
    assert check_op(torch.ops.aten.gelu.default, torch.tensor([-7.03125]), target="cpu/bf16").passed


@parity_settings(max_examples=15)
@given(inp=op_inputs(torch.ops.aten.mm.default, dtype=torch.bfloat16, allow_nan=False, allow_inf=False))
def test_bf16_mm_is_within_its_condition_aware_budget(inp):
    a, b = inp.args
    # a product beyond float32's range overflows in any fp32-accumulating kernel: out of scope
    assume(bool((a.double().abs() @ b.double().abs()).max() < 1e38) if a.numel() and b.numel() else True)
    assert_op_parity(torch.ops.aten.mm.default, *inp.args, target="cpu/bf16")
