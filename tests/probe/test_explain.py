"""explain(): a card turned into the sentence a bisect finding quotes."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.probe import Card, Kernels, explain, probe
from precisiondiff.probe.explain import summation_depth

from . import planted  # noqa: F401

OPS = torch.ops.pdprobe_test


@pytest.fixture(scope="module")
def trunc14_card():
    k = Kernels.stock("cpu", torch.float32).replace(gemm=OPS.trunc14_mm)
    return probe(kernels=k, ops=["gemm"])


def test_a_14_bit_truncating_gemm(trunc14_card):
    text = explain(trunc14_card, "gemm", "fp32", 4096)
    # u = 2**(1-14) for truncation; sequential: 4096 additions deep -> 4096 * 2**-13 = 0.5
    assert text.startswith("this device's fp32 gemm accumulates in 14 bits (rounding toward-zero): "
                           "summing K=4096 terms (sequential, 4096 additions deep) can lose up to 0.5 of sum|terms|")
    assert "typically 0.0078" in text
    assert "against 0.00024 with a float32 accumulator" in text
    assert "rounded to" not in text  # the inputs are not narrower than the accumulator


def test_tf32_inputs_and_split_partials_are_mentioned():
    tf32 = probe(kernels=Kernels.stock("cpu", torch.float32).replace(gemm=OPS.tf32_mm), ops=["gemm"])
    assert "its inputs are rounded to 11 bits before the product" in explain(tf32, "gemm", torch.float32, 1024)
    split = Card("cpu/bf16")
    for prop, value in [("accumulator_bits", 24), ("long_sum_bits", 8), ("rounding", "nearest-even"),
                        ("order", "split-K 4"), ("batch_invariant", False)]:
        split.add("gemm", "gemm", prop, value)
    text = explain(split, "gemm", "bf16", 4096)
    assert "keeps partial sums of long reductions in 8 bits" in text
    assert "split-K 4, 1028 additions deep" in text
    assert text.endswith("a row's result depends on the batch it is computed in")


def test_what_the_card_cannot_say(trunc14_card):
    assert explain(trunc14_card, "gemm", "bf16", 64) == \
        "the card of cpu/fp32 says nothing about bf16: probe the bf16 target"
    assert explain(trunc14_card, "sum", "fp32", 64) == \
        "the card of cpu/fp32 has no accumulator measurement for sum"


@pytest.mark.parametrize("order, k, depth", [("sequential", 4096, 4096), ("pairwise", 4096, 12),
                                             ("blocked 128", 4096, 160), ("blocked 128", 64, 65),
                                             ("split-K 4", 4096, 1028), ("unrecognised", 100, 100),
                                             (None, 10, 10), ("shape-dependent: K=64: sequential", 8, 8)])
def test_summation_depth(order, k, depth):
    assert summation_depth(order, k) == depth
