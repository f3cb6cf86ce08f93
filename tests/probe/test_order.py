"""Summation order: known trees are recognised from the (+M, -M) experiment alone."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.probe import Kernels
from precisiondiff.probe.order import hypotheses, lca_sizes, reveal, summation_order

from .planted import accumulate, round_bits


def tree_sum(x: torch.Tensor, tree) -> torch.Tensor:
    """Sum the columns of x [R, K] along ``tree`` with a float32 accumulator."""
    if isinstance(tree, int):
        return x[:, tree]
    return round_bits(tree_sum(x, tree[0]) + tree_sum(x, tree[1]), 24)


def kernel_for(name: str):
    def fn(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        return tree_sum(x.double(), hypotheses(n)[name][2]).to(x.dtype)
    return fn


def test_lca_sizes_of_a_small_tree():
    sizes = lca_sizes(((0, 1), (2, 3)), 4)
    assert sizes[0, 1] == 2 and sizes[2, 3] == 2
    assert sizes[0, 2] == 4 and sizes[1, 3] == 4
    chain = lca_sizes(((0, 1), 2), 3)
    assert chain[0, 1] == 2 and chain[0, 2] == 3 and chain[1, 2] == 3


@pytest.mark.parametrize("name", ["sequential", "pairwise", "blocked 16", "blocked 8, pairwise across",
                                  "strided 8 lanes, halving", "strided 16 lanes, adjacent pairs",
                                  "strided 4 lanes, in order"])
def test_each_known_order_is_recognised(name):
    k = Kernels.stock("cpu", torch.float32).replace(sum=kernel_for(name))
    assert summation_order(k, "sum", 64, 24)[0] == name


def test_a_tree_outside_the_hypotheses_is_unrecognised_with_its_spine():
    def odd(x):  # term 0 joins last: (((1 + 2) + 3) ...) + 0
        tree = 1
        for i in range(2, x.shape[-1]):
            tree = (tree, i)
        return tree_sum(x.double(), (tree, 0)).to(x.dtype)

    k = Kernels.stock("cpu", torch.float32).replace(sum=odd)
    name, evidence = summation_order(k, "sum", 64, 24)
    assert name == "unrecognised"
    assert "subtrees holding term 0 have 64 terms" in evidence


def test_fixed_blocks_and_fixed_splits_are_told_apart_across_k():
    def blocks_of(b):
        def fn(x):
            t = x.double()
            parts = [accumulate(t[:, s:s + b], 24) for s in range(0, t.shape[-1], b)]
            return accumulate(torch.stack(parts, -1), 24).to(x.dtype)
        return fn

    def splits_of(s):
        return lambda x: blocks_of(x.shape[-1] // s)(x)

    fixed = Kernels.stock("cpu", torch.float32).replace(sum=blocks_of(32))
    split = Kernels.stock("cpu", torch.float32).replace(sum=splits_of(8))
    assert reveal(fixed, "sum", 24)[0] == "blocked 32"
    assert reveal(split, "sum", 24)[0] == "split-K 8"


def test_fp16_sums_without_range_are_not_revealed():
    k = Kernels.stock("cpu", torch.float16)
    value, evidence = reveal(k, "sum", 24)
    assert value == "not revealed"
    assert "too little range" in evidence
