"""assert_ulp_close: passes within the ULP bound, fails with the pinned message."""
from __future__ import annotations

import math

import pytest
import torch

from precisiondiff import testing
from precisiondiff.errors import PrecisionDiffError
from precisiondiff.testing import assert_ulp_close


def test_all_is_literal_and_exports_assert_ulp_close():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(testing))
    lit = [n.value for n in tree.body if isinstance(n, ast.Assign)
           and any(getattr(t, "id", None) == "__all__" for t in n.targets)]
    assert lit and isinstance(lit[0], ast.List)
    assert "assert_ulp_close" in testing.__all__


def test_passes_within_bound_and_signed_zero_and_nan():
    x = torch.tensor([1.0, 2.0, 0.0, math.nan], dtype=torch.bfloat16)
    e = torch.tensor([1.0 + 2**-8, 2.0, -0.0, math.nan], dtype=torch.float64)
    assert_ulp_close(x, e, max_ulp=1)
    assert_ulp_close(x[:3], e[:3] * 0, max_ulp=2**20)


def test_message_pinned():
    a = torch.tensor([[1.0, 2.0], [3.0, math.nan]], dtype=torch.bfloat16)
    e = torch.tensor([[1.0, 2.0625], [3.0, 4.0]], dtype=torch.float64)
    with pytest.raises(AssertionError) as info:
        assert_ulp_close(a, e)
    assert str(info.value) == (
        "Tensor-likes are not ULP-close!\n\n"
        "Mismatched elements: 2 / 4 (50.0%)\n"
        "Greatest absolute difference: 0.0625 at index (0, 1) (actual 2.0, expected 2.0625)\n"
        "Greatest relative difference: 0.030303 at index (0, 1) (actual 2.0, expected 2.0625)\n"
        "Greatest ULP distance: nan at index (1, 1) (up to 1 ULP of bfloat16 allowed)\n"
        "Worst 2 elements (index: actual, expected, ULP):\n"
        "  (1, 1): nan, 4.0, nan\n"
        "  (0, 1): 2.0, 2.0625, 4\n"
        "Hint: if the op is approximate by design raise max_ulp; otherwise compare against a "
        "float64 golden with precisiondiff.comparators.compare_tensors.")


def test_equal_nan_false_and_msg_and_shape():
    a = torch.tensor([math.nan])
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 1"):
        assert_ulp_close(a, a.clone(), equal_nan=False)
    with pytest.raises(AssertionError, match="^custom$"):
        assert_ulp_close(torch.ones(1), torch.zeros(1), msg="custom")
    with pytest.raises(AssertionError, match="^ctx: Tensor-likes"):
        assert_ulp_close(torch.ones(1), torch.zeros(1), msg=lambda m: "ctx: " + m)
    with pytest.raises(AssertionError, match=r"shapes differ, actual \(2,\) vs expected \(3,\)"):
        assert_ulp_close(torch.ones(2), torch.ones(3))
    with pytest.raises(PrecisionDiffError):
        assert_ulp_close(torch.ones(2, dtype=torch.int32), torch.ones(2))


def test_zero_dim_index_and_dtype_argument():
    with pytest.raises(AssertionError, match=r"at index \(\)"):
        assert_ulp_close(torch.tensor(1.0), torch.tensor(2.0))
    assert_ulp_close(torch.tensor([1.0 + 2**-10]), torch.tensor([1.0]), dtype=torch.bfloat16, max_ulp=0)


def test_traceback_is_hidden():
    import inspect
    assert "__tracebackhide__ = True" in inspect.getsource(assert_ulp_close)
