"""ULP sweeps and IEEE corner cases, on planted kernels."""
from __future__ import annotations

import torch

from precisiondiff.comparators.ulp import round_to_dtype
from precisiondiff.probe import Kernels, probe
from precisiondiff.probe.accuracy import elementwise_accuracy, sweep_inputs


def device(dtype, **ops):
    return Kernels.stock("cpu", dtype).replace(**ops)


def correctly_rounded_exp(x):
    return round_to_dtype(torch.exp(x.double()), x.dtype)


def coarse_exp(x):  # exp(x) = 2 ** (x * log2 e) with the product rounded to the dtype first
    return torch.exp2((x * 1.4426950408889634).to(x.dtype).double()).to(x.dtype)


def test_sweeps_cover_every_finite_16_bit_value():
    x = sweep_inputs(torch.bfloat16)
    finite = x[:-3]
    assert finite.numel() == 65536 - 256  # all bit patterns but the 2 infinities and 254 NaNs
    assert torch.isfinite(finite).all()
    assert finite.unique().numel() == finite.numel() - 1  # +0 and -0 compare equal
    assert x[-3] == float("inf") and x[-2] == float("-inf") and x[-1].isnan()


def test_a_correctly_rounded_function_is_within_half_an_ulp():
    stats = elementwise_accuracy(device(torch.bfloat16, exp=correctly_rounded_exp), "exp")
    assert stats["max_ulp"] <= 0.5
    assert stats["special"] == 0 and stats["flushed"] == 0


def test_a_coarse_function_shows_its_worst_input():
    stats = elementwise_accuracy(device(torch.bfloat16, exp=coarse_exp), "exp")
    assert stats["max_ulp"] > 2
    worst = torch.tensor([stats["worst_input"]], dtype=torch.bfloat16)
    err = (coarse_exp(worst).double() - torch.exp(worst.double())).abs()
    spacing = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(torch.exp(worst.double())))
    assert float(err / spacing) == stats["max_ulp"] or abs(float(err / spacing) - stats["max_ulp"]) < 1e-3


def test_flushed_subnormal_results_and_special_values_are_counted():
    def ftz_exp(x):
        y = torch.exp(x)
        return torch.where(y.abs() < torch.finfo(y.dtype).tiny, torch.zeros_like(y), y)

    def nan_at_inf_gelu(x):  # correctly rounded, except gelu(+-inf) = NaN
        y = round_to_dtype(torch.nn.functional.gelu(x.double()), x.dtype)
        return torch.where(torch.isinf(x), torch.full_like(y, float("nan")), y)

    card = probe(kernels=device(torch.float32, exp=ftz_exp, gelu=nan_at_inf_gelu), ops=["exp", "gelu"])
    assert card.get("exp", "subnormal_results") == "flushed"
    assert card.get("gelu", "special_values") == 2
    assert card.finding("gelu", "special_values").detail.endswith("f(inf) = nan, reference inf")
    assert card.get("gelu", "max_ulp") <= 0.5


def test_nan_payload_and_signed_zero():
    def canonical_mul(x, y):
        out = x * y
        return torch.where(out.isnan(), torch.full_like(out, float("nan")), out)

    def keeping_mul(x, y):
        return torch.where(x.isnan(), x, x * y)

    def plus_zero_add(x, y):  # an adder that drops the sign of zero results
        out = x + y
        return torch.where(out == 0, torch.zeros_like(out), out)

    canon = probe(kernels=device(torch.float32, mul=canonical_mul, add=plus_zero_add), ops=["mul", "add"])
    assert canon.get("mul", "nan_payload") == "canonical"
    assert canon.get("add", "signed_zero") == "non-IEEE"
    assert "-0+-0 = +0" in canon.finding("add", "signed_zero").detail
    keep = probe(kernels=device(torch.float32, mul=keeping_mul), ops=["mul", "add"])
    assert keep.get("mul", "nan_payload") == "propagated"
    assert keep.get("add", "signed_zero") == "IEEE"
