"""Fill constants that differ between dtypes by design (torch.finfo(dtype).min, +-inf) are not
divergence (compare/constants.py); an overflow still is."""
from __future__ import annotations

import os

import torch
from hypothesis import given
from hypothesis import strategies as st

from precisiondiff.compare import compare
from precisiondiff.compare.constants import constant_fill_note, fill_mask

MASKED = os.path.join(os.path.dirname(__file__), "planted.py") + ":build_masked"
FILLS = {torch.bfloat16: [torch.finfo(torch.bfloat16).min, -float("inf")],
         torch.float16: [torch.finfo(torch.float16).min, -float("inf")],
         torch.float32: [torch.finfo(torch.float32).min, -float("inf")]}


@given(st.sampled_from(sorted(FILLS, key=str)), st.lists(st.booleans(), min_size=1, max_size=64),
       st.integers(0, 1), st.integers(0, 1), st.integers(0, 2 ** 32 - 1))
def test_fills_at_the_same_positions_are_found_and_nothing_else(dtype, where, fa, fb, seed):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(len(where), generator=g, dtype=torch.float64)
    a = b.to(dtype)
    mask = torch.tensor(where)
    a[mask] = FILLS[dtype][fa]
    b[mask] = (torch.finfo(torch.float64).min, -float("inf"))[fb]
    found = fill_mask(a, b)
    if not mask.any() or (fa == 1 and fb == 1):  # no fill, or -inf on both sides: equal anyway
        assert found is None
    else:
        assert torch.equal(found, mask)
        # a fill where the other side holds an ordinary value is an overflow: not excused
        moved = b.clone()
        first = int(mask.nonzero()[0])
        moved[first] = 1.0
        assert fill_mask(a, moved) is None
        # a fill of the opposite sign is another value, not the same constant
        flipped = b.clone()
        flipped[first] = -flipped[first]
        assert fill_mask(a, flipped) is None


def test_an_ordinary_large_value_is_not_a_fill():
    a = torch.tensor([3.0e38], dtype=torch.bfloat16)  # near bf16's max, but B holds it too
    assert fill_mask(a, torch.tensor([-3.0e38], dtype=torch.float64)) is None
    assert fill_mask(torch.tensor([float("inf")]), torch.tensor([3.0e38], dtype=torch.float64)) is None


def test_constant_fills_in_stats_dumps():
    bf16_min, f64_min = float(torch.finfo(torch.bfloat16).min), float(torch.finfo(torch.float64).min)
    const = lambda v: {"min": v, "max": v, "nan": 0, "inf": 0}  # noqa: E731
    assert "constant tensors" in constant_fill_note(const(bf16_min), const(f64_min), "bfloat16", "float64")
    partial = {"min": bf16_min, "max": 2.0, "nan": 0}
    assert "not judged in stats mode" in constant_fill_note(partial, {"min": f64_min, "max": 2.0, "nan": 0},
                                                            "bfloat16", "float64")
    assert constant_fill_note(const(bf16_min), const(-5.0), "bfloat16", "float64") is None
    assert constant_fill_note(const(bf16_min), const(-f64_min), "bfloat16", "float64") is None


def test_a_finfo_min_attention_mask_is_not_a_divergence(capture_example):
    for mode in ("tensors", "stats"):
        c = compare(capture_example("cpu/bf16", "op", mode, spec=MASKED),
                    capture_example("cpu/float64", "op", mode, spec=MASKED))
        assert c.summary["failed"] == 0, [r.message for r in c.rows if r.verdict == "fail"]
        noted = {r.name for r in c.rows if r.note}
        assert "aten.masked_fill.Scalar" in noted, mode
        assert all("finfo(bfloat16).min in A vs finfo(float64).min in B" in r.note for r in c.rows if r.note)
        softmax = [r for r in c.rows if r.name.startswith("aten._softmax")]
        assert softmax and all(r.verdict == "pass" and not r.note for r in softmax)  # same effect downstream
