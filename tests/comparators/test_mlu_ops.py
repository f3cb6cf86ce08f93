"""The mlu-ops acceptance rule (comparators/mlu_ops.py): its formulas, classes, thresholds, and
verdicts on planted kernels, through check_op and bisect."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from precisiondiff.comparators.mlu_ops import (MLU_OPS_FACTOR, judge_mlu_ops, mlu_ops_class, mlu_ops_diffs,
                                               static_thresholds)
from precisiondiff.testing.parity import check_op

settings.register_profile("mlu_ops", max_examples=40, deadline=None)


def _direct(a: torch.Tensor, b: torch.Tensor, th: float):
    """evaluator.h's computeDiff1/2/3 written out element by element (without its 1e-9)."""
    a, b = a.double().tolist(), b.double().tolist()
    s_abs = sum(abs(x - y) for x, y in zip(a, b))
    s_b = sum(abs(y) for y in b)
    s_d2 = sum((x - y) ** 2 for x, y in zip(a, b))
    s_b2 = sum(y * y for y in b)
    d3 = max((abs(x - y) if abs(y) < th else abs(x - y) / abs(y)) for x, y in zip(a, b))
    return s_abs / s_b, math.sqrt(s_d2 / s_b2), d3


@settings(settings.get_profile("mlu_ops"))
@given(st.integers(1, 300), st.integers(0, 2 ** 31 - 1), st.sampled_from([torch.float32, torch.bfloat16,
                                                                           torch.float16]),
       st.floats(1e-6, 10.0))
def test_diffs_are_mlu_ops_formulas(n, seed, dtype, scale):
    g = torch.Generator().manual_seed(seed)
    golden = torch.randn(n, generator=g, dtype=torch.float64) * scale
    golden[0] = 1.0  # a nonzero denominator
    actual = (golden * (1 + 0.01 * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)
    th = 1e-6 if dtype == torch.float32 else 1e-4
    d1, d2, d3 = _direct(actual, golden, th)
    got = mlu_ops_diffs(actual, golden)
    assert got["diff1"] == pytest.approx(d1, rel=1e-9)
    assert got["diff2"] == pytest.approx(d2, rel=1e-9)
    assert got["diff3"] == pytest.approx(d3, rel=1e-9)


@pytest.mark.parametrize("op,cls", [
    ("aten.mm.default", "convolution"), ("aten.convolution.default", "convolution"), ("Linear", "convolution"),
    ("aten.add.Tensor", "arithmetic"), ("aten.mul_.Tensor", "arithmetic"), ("aten._to_copy.default", "io"),
    ("aten.cat.default", "io"), ("aten.gelu.default", "activation"), ("aten.exp.default", "activation"),
    ("aten.sum.dim_IntList", "accumulation"), ("aten.index_add.default", "atomic"),
    ("aten.embedding_dense_backward.default", "atomic"), ("aten.native_layer_norm.default", "composite"),
    ("aten._softmax.default", "composite"), ("mylib.fused.default", "composite")])
def test_op_classes(op, cls):
    assert mlu_ops_class(op) == cls


def test_static_thresholds_cited_values():
    assert static_thresholds("convolution", torch.float32) == {"diff1": 1e-5, "diff2": 1e-5}
    assert static_thresholds("convolution", torch.float16) == {"diff1": 3e-3, "diff2": 3e-3}
    assert static_thresholds("activation", torch.float32) == {"diff1": 3e-3, "diff2": 3e-3}
    assert static_thresholds("arithmetic", torch.bfloat16) == {"diff3": 0.0}


@settings(settings.get_profile("mlu_ops"))
@given(st.integers(8, 2000), st.integers(0, 2 ** 31 - 1))
def test_correctly_rounded_passes(n, seed):
    """Exact classes pass on the static threshold alone; an inexact op's correctly rounded bf16
    result can exceed the static 3e-3 (half's value, bf16's rounding is coarser), and passes by the
    dynamic threshold against a correctly rounded baseline."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    for op, golden in (("aten.add.Tensor", x + y), ("aten._to_copy.default", x)):
        v = judge_mlu_ops(golden.to(torch.bfloat16), golden, {}, op=op)
        assert v.passed, v.message
    golden = torch.nn.functional.gelu(x)
    v = judge_mlu_ops(golden.to(torch.bfloat16), golden, {"float32": golden.to(torch.bfloat16)},
                      op="aten.gelu.default")
    assert v.passed, v.message


@settings(settings.get_profile("mlu_ops"))
@given(st.integers(64, 2000), st.integers(0, 2 ** 31 - 1))
def test_truncating_cast_fails_the_exact_class(n, seed):
    """An fp32 -> bf16 cast that rounds toward zero: within the elementwise ULP budget and the peer
    rule's size rules, but an exact op must equal the correctly rounded value (diff3 == 0)."""
    g = torch.Generator().manual_seed(seed)
    golden = torch.randn(n, generator=g, dtype=torch.float64).float().double()
    trunc = (golden.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    correct = golden.to(torch.bfloat16)
    v = judge_mlu_ops(trunc, golden, {"float32": correct}, op="aten._to_copy.default")
    assert not v.passed and v.criteria["diff3"]["threshold"] == 0.0
    assert "diff3" in v.message and v.baseline == "emulated"


def test_dynamic_threshold_is_ten_times_the_baseline():
    """A kernel over the static threshold passes within 10x its baseline's error, fails beyond;
    a real peer, when named, is the baseline alone."""
    g = torch.Generator().manual_seed(1)
    golden = torch.randn(4096, generator=g, dtype=torch.float64)
    noisy = lambda r: (golden * (1 + r * torch.randn(4096, generator=g, dtype=torch.float64))).to(torch.float32)  # noqa: E731
    baseline, within, beyond = noisy(2e-3), noisy(1.2e-2), noisy(4e-2)
    assert not judge_mlu_ops(within, golden, {}, op="aten.gelu.default").passed  # static 3e-3 alone
    v = judge_mlu_ops(within, golden, {"gpu": baseline}, op="aten.gelu.default", real_peer="gpu")
    b = v.criteria["diff2"]["baseline"]
    assert v.passed and v.criteria["diff2"]["threshold"] == pytest.approx(MLU_OPS_FACTOR * b)
    assert not judge_mlu_ops(beyond, golden, {"gpu": baseline}, op="aten.gelu.default", real_peer="gpu").passed
    # the real peer alone is the baseline: a more lenient emulated peer does not count
    lax = noisy(5e-2)
    v = judge_mlu_ops(beyond, golden, {"gpu": baseline, "float32": lax}, op="aten.gelu.default", real_peer="gpu")
    assert not v.passed and v.baseline == "gpu"
    assert judge_mlu_ops(beyond, golden, {"gpu": baseline, "float32": lax}, op="aten.gelu.default").passed


def test_nan_no_peer_explains_fails():
    golden = torch.ones(16, dtype=torch.float64)
    out = golden.to(torch.bfloat16).clone()
    out[3] = float("nan")
    v = judge_mlu_ops(out, golden, {"float32": golden.to(torch.bfloat16)}, op="aten.gelu.default")
    assert not v.passed and v.special_mismatch == 1


def _rtz_add(a, b):
    """A planted bf16 add that truncates its float32 sum (correct in other dtypes)."""
    if a.dtype != torch.bfloat16:
        return a + b
    s = (a.float() + b.float()).contiguous()
    return (s.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def test_check_op_mlu_ops_rule():
    torch.manual_seed(0)
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    stock = check_op(torch.ops.aten.add.Tensor, x, y, target="cpu/bf16", rule="mlu-ops")
    assert stock.passed and stock.checks[0].bound["rule"] == "mlu-ops"
    assert stock.checks[0].bound["op_class"] == "arithmetic"
    planted = check_op(_rtz_add, x, y, target="cpu/bf16", rule="mlu-ops", name="aten.add.Tensor")
    c = planted.checks[0]
    assert not planted.passed and c.bound["rule"] == "mlu-ops" and c.bound["criteria"]["diff3"]["value"] > 0
    assert c.bound["baseline"] == "emulated" and c.bound["notes"]
    with pytest.raises(ValueError, match="unknown rule"):
        check_op(torch.ops.aten.add.Tensor, x, y, target="cpu/bf16", rule="nope")


def test_bisect_rule_mlu_ops_names_the_plant_and_says_so():
    from precisiondiff.bisect import bisect
    from tests.bisect import planted
    r = bisect(planted.amplify_workload, target="cpu/bf16", rule="mlu-ops")
    assert r.verdict == "kernel" and r.culprit["name"] == "pdtest.sloppy_scale.default"
    assert r.culprit["peer"]["rule"] == "mlu-ops"
    assert any("--rule mlu-ops without --peer" in n for n in r.notes)
    clean = bisect(planted.mlp_workload, target="cpu/bf16", rule="mlu-ops")
    assert clean.verdict in ("parity", "accumulated")


def test_cli_rule(tmp_path):
    from precisiondiff.cli import cli as main
    runner = CliRunner()
    res = runner.invoke(main, ["bisect", "tests/bisect/planted.py:amplify_workload", "--target", "cpu/bf16",
                               "--rule", "mlu-ops"])
    assert res.exit_code == 1, res.output
    assert "mlu-ops rule decided" in res.output
    out = tmp_path / "r.json"
    res = runner.invoke(main, ["bisect", "tests/bisect/planted.py:amplify_workload", "--target", "cpu/bf16",
                               "--rule", "mlu-ops", "--format", "json", "-o", str(out)])
    assert json.loads(out.read_text())["culprit"]["peer"]["criteria"]
    bad = runner.invoke(main, ["bisect", "tests/bisect/planted.py:amplify_workload", "--rule", "x"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
