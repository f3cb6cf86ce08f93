"""K and randomness read off an op's schema: one helper for bisect and the plugin."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from precisiondiff.comparators.accumulation import LastOp, accumulation_lengths, is_random_call, magnitude_op


def _k(fn, *args, **kwargs):
    with LastOp() as rec:
        fn(*args, **kwargs)
    return str(rec.op), rec.ks


def test_convolution_accumulates_input_channels_per_group_times_kernel():
    assert _k(F.conv2d, torch.randn(2, 6, 8, 8), torch.randn(4, 3, 3, 3), groups=2) == ("aten.convolution.default", [27])
    assert _k(F.conv1d, torch.randn(1, 5, 9), torch.randn(7, 5, 4))[1] == [20]


def test_addmm_with_a_one_dimensional_bias_accumulates_the_inner_dimension():
    a, b, bias = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)
    assert accumulation_lengths("aten.addmm.default", [bias, a, b], {}, [a @ b]) == [3]
    assert _k(F.linear, torch.randn(2, 7), torch.randn(5, 7), torch.randn(5)) == ("aten.addmm.default", [7])


def test_convolution_backward_k_per_output():
    go, x, w = torch.randn(2, 4, 6, 6), torch.randn(2, 6, 8, 8), torch.randn(4, 3, 3, 3)
    ks = accumulation_lengths("aten.convolution_backward.default",
                              [go, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 2, [True, True, True]], {},
                              [x, w, torch.randn(4)])
    assert ks == [2 * 9, 2 * 36, 2 * 36]


def test_attention_reductions_and_embedding_backward():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 11, 8)
    assert accumulation_lengths("aten._scaled_dot_product_flash_attention_for_cpu.default", [q, k, k], {},
                                [q, torch.randn(1, 2, 5)]) == [11, 11]
    x = torch.randn(3, 4, 5)
    assert accumulation_lengths("aten.sum.dim_IntList", [x, [1]], {}, [x.sum(1)]) == [4]
    idx = torch.zeros(64, dtype=torch.long)
    assert accumulation_lengths("aten.embedding_dense_backward.default", [torch.randn(64, 8), idx, 4, -1, False],
                                {}, [torch.randn(4, 8)]) == [64]
    assert accumulation_lengths("aten.native_layer_norm.default", [x, [5], None, None, 1e-5], {}, [x]) == [5]


def test_magnitude_ops_are_the_multilinear_ones():
    assert magnitude_op("aten.mm.default") and magnitude_op("aten.convolution_backward.default")
    assert not magnitude_op("aten.gelu.default") and not magnitude_op("pdtest.fused_softmax.default")


@pytest.mark.parametrize("op,args,kwargs,random", [
    (torch.ops.aten.bernoulli_.float, [torch.empty(3), 0.5], {}, True),
    (torch.ops.aten.native_dropout.default, [torch.empty(3), 0.1, True], {}, True),
    (torch.ops.aten.native_dropout.default, [torch.empty(3), 0.1, False], {}, False),
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, [None, None, None], {"dropout_p": 0.0}, False),
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, [None, None, None, 0.1], {}, True),
    (torch.ops.aten.add.Tensor, [None, None], {}, False),
])
def test_random_calls_are_the_seeded_nondeterministic_ones_that_draw(op, args, kwargs, random):
    assert is_random_call(op, args, kwargs) is random
