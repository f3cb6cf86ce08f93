"""precisiondiff.strategies: coverage of special values and validity of generated op inputs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from precisiondiff.errors import PrecisionDiffError
from precisiondiff.strategies import (
    bit_format,
    broadcastable_shapes,
    op_inputs,
    shapes,
    special_values,
    tensors,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
SEARCH = settings(max_examples=500, deadline=None, database=None)
FAST = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _values(t: torch.Tensor) -> list:
    return t.to(torch.float64).flatten().tolist()


def _has(predicate):
    return lambda t: any(predicate(v) for v in _values(t))


def _decode(pattern: int, dtype: torch.dtype) -> float:
    bits = bit_format(dtype).bits
    storage = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[bits]
    if bits > 8 and pattern >= 1 << (bits - 1):
        pattern -= 1 << bits
    return float(torch.tensor([pattern], dtype=storage).view(dtype)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_decode_to_what_they_name(dtype):
    fmt = bit_format(dtype)
    values = special_values(dtype)
    decode = {k: _decode(v, dtype) for k, v in values.items()}
    assert decode["one"] == 1.0 and decode["-one"] == -1.0
    assert decode["zero"] == 0.0 and math.copysign(1, decode["-zero"]) == -1.0
    assert math.isnan(decode["nan"])
    assert decode["max_finite"] == torch.finfo(dtype).max
    assert decode["min_normal"] == torch.finfo(dtype).tiny
    assert 0 < decode["min_subnormal"] < decode["max_subnormal"] < decode["min_normal"]
    if fmt.ieee:
        assert decode["inf"] == math.inf and decode["-inf"] == -math.inf
    else:
        assert "inf" not in values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("what", ["nan", "+inf", "-inf", "-0.0", "subnormal", "huge"])
def test_tensors_reach_every_special_class(dtype, what):
    if what.endswith("inf") and not bit_format(dtype).ieee:
        pytest.skip(f"{dtype} has no infinity")
    tiny = torch.finfo(dtype).tiny
    predicate = {
        "nan": math.isnan,
        "+inf": lambda v: v == math.inf,
        "-inf": lambda v: v == -math.inf,
        "-0.0": lambda v: v == 0 and math.copysign(1, v) < 0,
        "subnormal": lambda v: v != 0 and abs(v) < tiny,
        "huge": lambda v: math.isfinite(v) and abs(v) >= torch.finfo(dtype).max / 4,
    }[what]
    found = find(tensors(dtype=dtype, shape=(16,)), _has(predicate), settings=SEARCH)
    assert any(predicate(v) for v in _values(found))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2], ids=str)
def test_disallowed_classes_never_appear(dtype):
    @FAST
    @given(t=tensors(dtype=dtype, shape=(8,), allow_nan=False, allow_inf=False, allow_subnormal=False))
    def check(t):
        tiny = torch.finfo(dtype).tiny
        assert all(math.isfinite(v) and (v == 0 or abs(v) >= tiny) for v in _values(t))
    check()


def test_elements_override_and_dtype():
    found = find(tensors(dtype=torch.float16, shape=(3,), elements=st.floats(-2, 2)),
                 lambda t: True, settings=FAST)
    assert found.dtype == torch.float16 and all(-2 <= v <= 2 for v in _values(found))


def test_shapes_include_scalar_empty_and_noncontiguous_views():
    assert find(shapes(), lambda s: s == (), settings=FAST) == ()
    assert 0 in find(shapes(), lambda s: 0 in s, settings=FAST)
    view = find(tensors(shape=(2, 3)), lambda t: not t.is_contiguous(), settings=FAST)
    assert view.shape == (2, 3)
    for layout in ("transposed", "strided"):
        t = find(tensors(shape=(2, 3), layout=layout), lambda t: True, settings=FAST)
        assert t.shape == (2, 3) and not t.is_contiguous()


@FAST
@given(pair=broadcastable_shapes())
def test_broadcastable_pairs_broadcast(pair):
    torch.broadcast_shapes(*pair)


def test_unsupported_dtype_raises():
    with pytest.raises(PrecisionDiffError, match="no tensor strategy for torch.int32"):
        bit_format(torch.int32)


OPS = [
    "aten.gelu.default", "aten.relu.default", "aten.exp.default", "aten.tanh.default",
    "aten.sigmoid.default", "aten.silu.default", "aten.add.Tensor", "aten.mul.Tensor",
    "aten.div.Tensor", "aten.maximum.default", "aten.sum.dim_IntList", "aten.mean.dim",
    "aten.amax.default", "aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default",
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.matmul.default", "aten.linear.default", "aten.layer_norm.default",
    "aten.native_layer_norm.default", "aten.rms_norm.default",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", OPS)
def test_generated_inputs_are_valid_for_the_op(name, dtype):
    ns, op_name, overload = name.split(".")
    op = getattr(getattr(getattr(torch.ops, ns), op_name), overload)

    @settings(max_examples=15, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(inp=op_inputs(op, dtype=dtype))
    def call(inp):
        op(*inp.args, **inp.kwargs)  # must not raise
    call()


def test_op_inputs_accepts_names_and_packets():
    inp = find(op_inputs(torch.ops.aten.mm), lambda i: True, settings=FAST)
    assert inp.args[0].shape[1] == inp.args[1].shape[0]
    inp = find(op_inputs("aten.gelu.default"), lambda i: i.kwargs["approximate"] == "tanh", settings=FAST)
    assert inp.kwargs == {"approximate": "tanh"}


def test_op_inputs_refuses_ops_it_cannot_fill():
    with pytest.raises(PrecisionDiffError, match="cannot make a valid"):
        find(op_inputs(torch.ops.aten.topk.default), lambda i: True, settings=FAST)


def test_package_import_does_not_import_hypothesis():
    import subprocess
    import sys
    code = "import sys, precisiondiff, precisiondiff.testing.plugin; print('hypothesis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
