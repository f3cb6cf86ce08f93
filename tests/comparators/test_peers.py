"""The peer rule: a correctly rounded kernel always passes, a kernel a few bits off fails, small
elements are judged by absolute error, NaN/Inf only fail when no peer explains them."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.comparators.peers import (
    compute_dtype,
    decomposition_peer,
    float32_peer,
    judge_against_peers,
    peer_factor,
    significance_floor,
)

SETTINGS = settings(max_examples=40, deadline=None)
shapes = st.integers(1, 64)
seeds = st.integers(0, 2**31 - 1)


def _golden(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


@SETTINGS
@given(n=shapes, seed=seeds, scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e4]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_correctly_rounded_result_passes_with_any_peer(n, seed, scale, dtype):
    g = _golden(n, seed, scale if dtype == torch.bfloat16 else min(scale, 1e3))
    rounded = g.to(dtype)
    assert judge_against_peers(rounded, g, {}).passed
    assert judge_against_peers(rounded, g, {"float32": rounded}).passed


@SETTINGS
@given(n=st.integers(8, 64), seed=seeds)
def test_result_off_by_two_to_the_minus_five_fails(n, seed):
    g = _golden(n, seed)
    wrong = (g * (1 + 2 ** -5)).to(torch.bfloat16)
    v = judge_against_peers(wrong, g, {"float32": g.to(torch.bfloat16)})
    assert not v.passed and "exceeds" in v.message


def test_peer_with_the_same_error_makes_a_kernel_pass():
    g = _golden(256, 0)
    sloppy = (g * (1 + 2 ** -5)).to(torch.bfloat16)
    assert judge_against_peers(sloppy, g, {"decomposition": sloppy}).passed
    assert not judge_against_peers(sloppy, g, {"decomposition": g.to(torch.bfloat16)}).passed


def test_small_elements_are_judged_by_absolute_error():
    g = torch.linspace(-10, 10, 1001, dtype=torch.float64)
    g[500] = -7.2e-12
    d = g.to(torch.bfloat16)
    d[500] = 0.0  # hundreds of ULP of that element, nothing at the tensor's scale
    v = judge_against_peers(d, g, {"float32": g.to(torch.bfloat16)})
    assert v.passed and v.max_error < 1


def test_infinity_fails_unless_a_peer_gives_it_too():
    g = torch.tensor([1.7e38, 1.0], dtype=torch.float64)
    d = torch.tensor([float("inf"), 1.0], dtype=torch.bfloat16)
    assert judge_against_peers(d, g, {"float32": g.to(torch.bfloat16)}).special_mismatch == 1
    assert judge_against_peers(d, g, {"float32": d.clone()}).passed


def test_floor_and_factor_follow_the_dtype():
    g = torch.full((4,), 2.0, dtype=torch.float64)
    assert significance_floor(g, torch.bfloat16) == pytest.approx(2 ** -8 * 4.0)
    assert peer_factor(torch.bfloat16) == 3.0 and peer_factor(torch.float32) == 2.0
    assert compute_dtype(torch.float32, [torch.bfloat16]) == torch.bfloat16


def test_float32_peer_rounds_once_and_decomposition_peer_needs_a_decomposition():
    x = torch.randn(4, 8).to(torch.bfloat16)
    f = float32_peer(torch.ops.aten.gelu.default, (x.float(),), {}, [torch.bfloat16])
    assert f[0].dtype == torch.bfloat16 and torch.equal(f[0], torch.nn.functional.gelu(x.float()).to(torch.bfloat16))
    assert decomposition_peer(torch.ops.aten.gelu.default, (x,), {}, [torch.bfloat16]) is not None
    assert decomposition_peer(torch.ops.aten.mm.default, (x, x.t()), {}, [torch.bfloat16]) is None


def test_relative_figures_are_finite_for_a_zero_golden():
    v = judge_against_peers(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.float64), {})
    assert v.passed and v.error == 0.0 and not math.isnan(v.ratio)
