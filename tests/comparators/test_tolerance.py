"""Budgets judge: correctly rounded results pass, bf16 accumulation fails, messages pinned."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.comparators import (
    OP_CLASSES,
    Budget,
    budget_for,
    compare_tensors,
    condition_bound,
    op_class,
    parse_budget_overrides,
    peer_ratio_check,
)
from precisiondiff.comparators.metrics import TensorMetrics
from precisiondiff.comparators.ulp import ComparatorError, round_to_dtype
from precisiondiff.errors import PrecisionDiffError

SETTINGS = settings(max_examples=30, deadline=None)
LOW = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name,cls", [
    ("aten.addmm.default", "matmul"), ("aten.mm", "matmul"), ("aten.bmm.default", "matmul"),
    ("aten.convolution.default", "matmul"), ("aten::linear", "matmul"),
    ("aten._softmax.default", "softmax"), ("aten.native_layer_norm.default", "normalization"),
    ("aten.sum.dim_IntList", "reduction"), ("aten.mean.dim", "reduction"),
    ("aten.add.Tensor", "elementwise"), ("aten.add_.Tensor", "elementwise"),
    ("aten.gelu.default", "elementwise"), ("Linear", "matmul"), ("Conv2d", "matmul"),
    ("LayerNorm", "normalization"), ("Softmax", "softmax"),
    ("torch.nn.modules.linear.Linear", "matmul"), ("mylib.fused_softmax.default", "unknown"),
    ("aten.some_new_op.default", "unknown"),
])
def test_op_class(name, cls):
    assert op_class(name) == cls


def test_every_class_has_a_budget_for_every_dtype():
    for dt in [torch.float64, torch.float32, *LOW, torch.float8_e4m3fn, torch.float8_e5m2]:
        for cls in OP_CLASSES:
            b = budget_for(dt, cls)
            assert b.max_ulp >= 0.5 and b.rounding_ulps >= 1.0 and b.op_class == cls


def _golden(kind: str, seed: int, k: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "elementwise":
        x = torch.randn(64, generator=g, dtype=torch.float64) * 3
        return torch.nn.functional.gelu(x), None
    if kind == "reduction":
        x = torch.randn(16, k, generator=g, dtype=torch.float64)
        return x.sum(1), x.abs().sum(1)
    a = torch.randn(8, k, generator=g, dtype=torch.float64)
    b = torch.randn(k, 8, generator=g, dtype=torch.float64)
    return a @ b, a.abs() @ b.abs()


@pytest.mark.parametrize("dtype", [*LOW, torch.float32, torch.float8_e4m3fn], ids=str)
@SETTINGS
@given(seed=st.integers(0, 2**31), kind=st.sampled_from(["elementwise", "reduction", "matmul"]),
       k=st.integers(1, 1024), cls=st.sampled_from(OP_CLASSES))
def test_correctly_rounded_result_always_passes(dtype, seed, kind, k, cls):
    gold, mag = _golden(kind, seed, k)
    r = round_to_dtype(gold, dtype)
    b = budget_for(dtype, cls)
    assert b.check(r, gold).passed
    if mag is not None:
        assert b.check(r, gold, magnitude=mag, k=k).passed
    assert b.judge_metrics(compare_tensors(r, gold)).passed


def _bf16_sequential(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A kernel that keeps its running sum in bf16 (the bug budgets must catch)."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)
    for i in range(a.shape[1]):
        acc = (acc.float() + a[:, i:i + 1].float() * b[i:i + 1, :].float()).to(torch.bfloat16)
    return acc


@SETTINGS
@given(seed=st.integers(0, 2**31), k=st.integers(64, 1024), m=st.integers(4, 16),
       n=st.integers(4, 16), positive=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_matmul_accumulated_in_bf16_fails_fp32_accumulated_passes(seed, k, m, n, positive, scale):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16)
    b = torch.randn(k, n, generator=g).to(torch.bfloat16)
    if positive:
        a, b = a.abs(), b.abs()
    gold = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    budget = budget_for(torch.bfloat16, "aten.mm.default")
    good = (a.float() @ b.float()).to(torch.bfloat16)
    assert budget.check(good, gold, magnitude=mag, k=k).passed
    bad = budget.check(_bf16_sequential(a, b), gold, magnitude=mag, k=k)
    assert not bad.passed
    assert "exceed the bfloat16 matmul budget" in bad.message


@SETTINGS
@given(seed=st.integers(0, 2**31), k=st.integers(64, 1024), rows=st.integers(16, 32))
def test_sum_accumulated_in_bf16_fails(seed, k, rows):
    # one lucky row can land within 1 ULP (a random walk); 16+ rows all doing so cannot
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    acc = torch.zeros(rows, dtype=torch.bfloat16)
    for i in range(k):
        acc = (acc.float() + x[:, i].float()).to(torch.bfloat16)
    gold, mag = x.double().sum(1), x.double().abs().sum(1)
    v = budget_for("bfloat16", "aten.sum.dim_IntList").check(acc, gold, magnitude=mag, k=k)
    assert not v.passed


@SETTINGS
@given(seed=st.integers(0, 2**31), k=st.integers(64, 1024))
def test_catastrophic_cancellation_computed_correctly_passes(seed, k):
    # sum of +big, -big and small terms: the result is tiny relative to the inputs, so the
    # fp32 accumulation error is many ULPs of the result, yet the kernel is correct.
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(k - 2, generator=g) * 1e-3
    big = float(torch.rand((), generator=g)) * 1e4 + 1e3
    x = torch.cat([torch.tensor([big]), small, torch.tensor([-big])]).to(torch.bfloat16)
    x = x[torch.randperm(k, generator=g)].reshape(1, k)
    acc = torch.zeros(1, dtype=torch.float32)
    for i in range(k):  # fp32 sequential, then one rounding
        acc = acc + x[:, i].float()
    got = acc.to(torch.bfloat16)
    gold, mag = x.double().sum(1), x.double().abs().sum(1)
    b = budget_for("bfloat16", "reduction")
    assert b.check(got, gold, magnitude=mag, k=k).passed
    bound = condition_bound("reduction", "bfloat16", k, mag)
    assert bound.item() == 2 * k * 2.0**-24 * mag.item()


def test_magnitude_and_k_go_together():
    b = budget_for("bfloat16", "matmul")
    with pytest.raises(ComparatorError, match="magnitude= and k= together"):
        b.check(torch.zeros(2), torch.zeros(2), magnitude=torch.ones(2))
    with pytest.raises(PrecisionDiffError, match="shapes differ"):
        b.check(torch.zeros(2), torch.zeros(3))


def test_verdict_message_pinned():
    gold = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    actual = torch.tensor([[1.0, 2.0], [3.0625, 4.0]], dtype=torch.bfloat16)
    v = budget_for("bfloat16", "aten.gelu.default").check(actual, gold, what="blocks.0.mlp.act")
    assert not v.passed and v.worst_index == (1, 0) and v.n_over == 1
    assert v.message == (
        "blocks.0.mlp.act: 1 of 4 elements (25%) exceed the bfloat16 elementwise budget.\n"
        "Worst at index (1, 0): actual 3.0625, golden 3.0: abs err 0.0625, rel err 0.0208, "
        "4 ULP; bound 0.0156 (1 ULP of bfloat16).\n"
        "Hint: replay the op on the reference with the same inputs (precisiondiff bisect); "
        "if the kernel is approximate by design, override max_ulp for it.")
    ok = budget_for("bfloat16", "elementwise").check(gold.to(torch.bfloat16), gold, what="x")
    assert ok.passed
    assert ok.message == "x: all 4 elements within the bfloat16 elementwise budget (1 ULP of bfloat16); worst 0 ULP."


def test_nan_where_reference_finite_always_fails():
    gold = torch.tensor([1.0, 2.0], dtype=torch.float64)
    actual = torch.tensor([1.0, math.nan], dtype=torch.bfloat16)
    v = budget_for("bfloat16", "unknown", overrides={"*": {"max_ulp": 1e9}}).check(actual, gold)
    assert not v.passed and v.nan_mismatch == 1 and v.worst_index == (1,)
    assert "NaN mismatches: 1, Inf mismatches: 0." in v.message
    assert not budget_for("bfloat16", "unknown").judge_metrics(compare_tensors(actual, gold)).passed


def test_judge_metrics_rejudges_saved_metrics():
    gold = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    actual = round_to_dtype(gold * (1 + 2**-7), torch.bfloat16)  # ~1-2 ULP off
    saved = TensorMetrics.from_dict(compare_tensors(actual, gold).to_dict())
    strict = budget_for("bfloat16", "elementwise", overrides={"*": {"max_ulp": 0.5}})
    loose = budget_for("bfloat16", "elementwise", overrides={"*": {"max_ulp": 8}})
    assert not strict.judge_metrics(saved, what="y").passed
    assert loose.judge_metrics(saved).passed
    msg = strict.judge_metrics(saved, what="y").message
    assert msg.startswith("y: ? of 100 elements exceed the bfloat16 elementwise budget.\nWorst: abs err")
    assert "bound 0.5 (0.5 ULP of bfloat16)" in msg


def test_overrides_apply_general_to_specific():
    ov = {"*": {"max_ulp": 3}, "bfloat16": {"max_ulp": 5}, "elementwise": {"rounding_ulps": 2},
          "aten.gelu": {"max_ulp": 7}}
    assert budget_for("bfloat16", "aten.gelu.default", overrides=ov).max_ulp == 7
    assert budget_for("bfloat16", "aten.relu.default", overrides=ov).max_ulp == 5
    assert budget_for("float32", "aten.relu.default", overrides=ov).max_ulp == 3
    assert budget_for("float32", "aten.relu.default", overrides=ov).rounding_ulps == 2
    assert budget_for("float32", "aten.gelu_backward.default", overrides=ov).max_ulp == 3
    with pytest.raises(ComparatorError, match="unknown budget field 'ulps'"):
        budget_for("float32", "matmul", overrides={"matmul": {"ulps": 1}})
    with pytest.raises(ComparatorError, match="finite and >= 0"):
        budget_for("float32", "matmul", overrides={"matmul": {"max_ulp": -1}})


def test_parse_budget_overrides():
    got = parse_budget_overrides(["max_ulp=4", "aten.mm:accum_factor=2", "aten::bmm:max_ulp=3",
                                  "matmul:accum_dtype=float64", "aten.mm:max_ulp=1"])
    assert got == {"*": {"max_ulp": 4.0}, "aten.mm": {"accum_factor": 2.0, "max_ulp": 1.0},
                   "aten::bmm": {"max_ulp": 3.0}, "matmul": {"accum_dtype": "float64"}}
    assert budget_for("bfloat16", "aten.mm.default", overrides=got).max_ulp == 1.0
    for bad in ["max_ulp", "max_ulp=", "=4", "foo=1", "max_ulp=x", "max_ulp=-2", ":max_ulp=1"]:
        with pytest.raises(ComparatorError):
            parse_budget_overrides([bad])


def test_peer_ratio_check():
    assert peer_ratio_check(2.9e-3, 1e-3, dtype="bfloat16")
    assert not peer_ratio_check(3.1e-3, 1e-3, dtype=torch.bfloat16)
    assert not peer_ratio_check(2.1e-3, 1e-3, dtype="float32")
    assert peer_ratio_check(5e-6, 0.0, dtype="float32")  # floor 1e-5
    assert peer_ratio_check(10.0, 1.0, factor=10.0, floor=0.0)
    assert not peer_ratio_check(math.nan, 1.0, factor=2.0)
    with pytest.raises(ComparatorError, match="factor= or dtype="):
        peer_ratio_check(1.0, 1.0)


def test_budget_is_frozen_and_unsupported_dtype_raises():
    b = budget_for("float16", "softmax")
    assert isinstance(b, Budget)
    with pytest.raises(Exception):
        b.max_ulp = 3  # type: ignore[misc]
    with pytest.raises(PrecisionDiffError):
        budget_for(torch.int8, "matmul")
    with pytest.raises(PrecisionDiffError):
        budget_for("floaty", "matmul")


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(LOW), shape=st.lists(st.integers(1, 9), min_size=0, max_size=3),
       seed=st.integers(0, 2**31), block=st.integers(1, 40), with_magnitude=st.booleans(),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([math.nan, math.inf, -math.inf, 1e300]),
                                   st.sampled_from(["actual", "golden", "magnitude"])), max_size=4))
def test_the_check_in_blocks_of_rows_is_the_check_in_one_pass(dtype, shape, seed, block, with_magnitude, specials):
    """Budget.check judges a large output a block of rows at a time (its float64 temporaries
    would otherwise be ~6x the output's float64 size): every field of the verdict, the worst
    element and the message included, is the one-pass verdict's, whatever the blocks, with NaN,
    infinities and goldens beyond the format's range in any block."""
    from precisiondiff.comparators import tolerance

    g = torch.Generator().manual_seed(seed)
    golden = torch.randn(tuple(shape), generator=g, dtype=torch.float64) * 3
    actual = (golden + torch.randn(tuple(shape), generator=g, dtype=torch.float64) * 0.02).to(dtype)
    magnitude = golden.abs() * 4 if with_magnitude else None
    tensors = {"actual": actual, "golden": golden, "magnitude": magnitude}
    for at, value, where in specials:
        t = tensors[where]
        if t is not None and t.numel():
            t.view(-1)[at % t.numel()] = value
    budget = budget_for(dtype, "matmul")
    kwargs = dict(magnitude=magnitude, k=64) if with_magnitude else {}
    saved = tolerance.CHECK_BLOCK_ELEMENTS
    try:
        tolerance.CHECK_BLOCK_ELEMENTS = 1 << 40
        whole = budget.check(actual, golden, **kwargs)
        tolerance.CHECK_BLOCK_ELEMENTS = block
        blocked = budget.check(actual, golden, **kwargs)
    finally:
        tolerance.CHECK_BLOCK_ELEMENTS = saved
    assert repr(blocked) == repr(whole)
