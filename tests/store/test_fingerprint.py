"""fingerprint: deterministic, layout-independent, sensitive to every bit and position."""
from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.store import fingerprint, fingerprint_hex, fingerprint_tensor

# the package attribute `fingerprint` is the function; the module lives in sys.modules
fp_mod = importlib.import_module("precisiondiff.store.fingerprint")

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int64, torch.int32, torch.uint8, torch.bool]


def test_shape_device_and_format():
    t = fingerprint_tensor(torch.randn(5))
    assert t.dtype == torch.int64 and t.shape == (2,) and t.device.type == "cpu"
    h = fingerprint_hex(t.tolist())
    assert len(h) == 32 and int(h, 16) >= 0
    assert fingerprint_hex([1, -1]) == "0000000000000001ffffffffffffffff"
    assert fingerprint(torch.zeros(0)) == "0" * 32


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_layout_independent(dtype):
    base = torch.randint(0, 2, (6, 5)).to(dtype) if dtype == torch.bool else \
        torch.randn(6, 5).to(dtype)
    assert fingerprint(base.t().contiguous().t()) == fingerprint(base)
    assert fingerprint(base.t()) == fingerprint(base.t().contiguous())
    assert fingerprint(base.t()) != fingerprint(base)  # same values, other order


def test_sensitive_to_bits_and_positions():
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert fingerprint(nan_a) != fingerprint(nan_b)
    assert fingerprint(torch.tensor([1.0, 2.0])) != fingerprint(torch.tensor([2.0, 1.0]))
    assert fingerprint(torch.tensor(3.0)) == fingerprint(torch.tensor([3.0]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-2**15, 2**15 - 1), min_size=1, max_size=64), st.data())
def test_single_bit_flip_changes_fingerprint(values, data):
    t = torch.tensor(values, dtype=torch.int16).view(torch.bfloat16)
    i = data.draw(st.integers(0, len(values) - 1))
    bit = data.draw(st.integers(0, 15))
    flipped = torch.tensor(values, dtype=torch.int16)
    flipped[i] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
    assert fingerprint(flipped.view(torch.bfloat16)) != fingerprint(t)


def test_chunking_gives_the_same_result(monkeypatch):
    t = torch.randn(1000)
    whole = fingerprint(t)
    monkeypatch.setattr(fp_mod, "_CHUNK", 7)
    assert fingerprint(t) == whole


def test_complex128_is_refused():
    with pytest.raises(TypeError, match="complex128"):
        fingerprint_tensor(torch.zeros(2, dtype=torch.complex128))
