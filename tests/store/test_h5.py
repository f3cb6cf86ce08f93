"""h5 conversion: dtypes numpy lacks are stored as raw bits and rebuilt exactly."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.store.h5 import from_numpy, to_numpy

from .helpers import assert_bitwise_equal


@pytest.mark.parametrize("dtype,raw", [(torch.bfloat16, "int16"), (torch.float8_e4m3fn, "uint8"),
                                       (torch.float8_e5m2, "uint8"), (torch.float16, "float16"),
                                       (torch.bool, "bool")])
@pytest.mark.parametrize("shape", [(), (0,), (3, 2)])
def test_to_and_from_numpy(dtype, raw, shape):
    t = torch.randn(shape).to(dtype)
    array, name = to_numpy(t)
    assert str(array.dtype) == raw and name == str(dtype).split(".")[1]
    assert array.shape == shape
    assert_bitwise_equal(from_numpy(array, name), t)


def test_width_mismatch_is_refused():
    array, _ = to_numpy(torch.ones(2, dtype=torch.float32))
    with pytest.raises(ValueError, match="cannot hold bfloat16"):
        from_numpy(array, "bfloat16")
