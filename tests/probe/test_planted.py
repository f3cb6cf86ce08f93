"""Emulated devices: every planted behaviour is recovered exactly, the rest reads as IEEE defaults."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.probe import Kernels, accumulator, probe

from . import planted  # noqa: F401  (registers the pdprobe_test ops)

OPS = torch.ops.pdprobe_test


def device(dtype: torch.dtype, **ops) -> Kernels:
    return Kernels.stock("cpu", dtype).replace(**ops)


def test_bf16_accumulator_gemm():
    card = probe(kernels=device(torch.bfloat16, gemm=OPS.bf16acc_mm), ops=["gemm"])
    assert card.get("gemm", "accumulator_bits") == 8
    assert card.get("gemm", "long_sum_bits") == 8
    assert card.get("gemm", "rounding") == "nearest-even"
    assert card.finding("gemm", "extra_bits") is None  # only measured for truncating accumulators
    # not planted: the defaults
    assert card.get("gemm", "input_bits") == 8
    assert card.get("gemm", "order") == "sequential"
    assert card.get("gemm", "deterministic") is True
    assert card.get("gemm", "batch_invariant") is True
    assert card.get("gemm", "subnormals") == "kept"
    assert card.meta["kernels"] == {"gemm": "pdprobe_test::bf16acc_mm"}


def test_14_bit_truncating_accumulator():
    card = probe(kernels=device(torch.float32, gemm=OPS.trunc14_mm), ops=["gemm"])
    assert card.get("gemm", "accumulator_bits") == 14
    assert card.get("gemm", "long_sum_bits") == 14
    assert card.get("gemm", "rounding") == "toward-zero"
    assert card.get("gemm", "extra_bits") == "exact"
    assert card.get("gemm", "input_bits") == ">=14"  # fp32 inputs cannot show through 14 bits
    assert card.get("gemm", "order") == "sequential"


def test_truncating_accumulator_with_three_extra_bits():
    k = device(torch.float32, gemm=OPS.trunc14x3_mm)
    bits, place, _ = accumulator.bits_kept(k, "gemm", accumulator.SHORT)
    assert bits == 14
    assert accumulator.rounding(k, "gemm", bits, place)[0] == "toward-zero"
    assert accumulator.extra_bits(k, "gemm", bits, place)[0] == 3


def test_stochastic_rounding():
    k = device(torch.float32, gemm=OPS.stochastic12_mm)
    bits, place, _ = accumulator.bits_kept(k, "gemm", accumulator.SHORT)
    assert bits == 12  # below 12 bits nothing is rounded; from 12 on t never comes back exact
    mode, evidence = accumulator.rounding(k, "gemm", bits, place)
    assert mode == "stochastic"
    assert "rounded away from zero in" in evidence


def test_tf32_inputs():
    card = probe(kernels=device(torch.float32, gemm=OPS.tf32_mm), ops=["gemm"])
    assert card.get("gemm", "input_bits") == 11
    assert card.get("gemm", "accumulator_bits") == 24
    assert card.get("gemm", "rounding") == "nearest-even"
    assert card.get("gemm", "order") == "sequential"


def test_split_k_with_bf16_partial_sums():
    card = probe(kernels=device(torch.bfloat16, gemm=OPS.splitk_mm), ops=["gemm"])
    assert card.get("gemm", "accumulator_bits") == 24
    assert card.get("gemm", "long_sum_bits") == 8
    assert card.get("gemm", "order") == "split-K 4"
    assert card.get("gemm", "batch_invariant") is True


def test_blocked_reduction_of_block_128():
    card = probe(kernels=device(torch.float32, sum=OPS.blocked128_sum), ops=["sum"])
    assert card.get("sum", "order") == "blocked 128"
    assert card.get("sum", "accumulator_bits") == 24
    assert card.get("sum", "long_sum_bits") == 24
    assert card.get("sum", "deterministic") is True
    assert card.get("sum", "batch_invariant") is True
    assert card.get("sum", "sum_of_negative_zeros") == "+0"


def test_nondeterministic_atomic_reduction():
    card = probe(kernels=device(torch.float32, sum=OPS.atomic_sum), ops=["sum"])
    assert card.get("sum", "deterministic") is False
    assert card.get("sum", "accumulator_bits") == 24  # inside a block the order is fixed


def test_batch_variant_reduction():
    card = probe(kernels=device(torch.float32, sum=OPS.batch_variant_sum), ops=["sum"])
    assert card.get("sum", "batch_invariant") is False
    assert card.get("sum", "deterministic") is True
    assert "batch of 1 " in card.finding("sum", "batch_invariant").detail


def test_flush_to_zero():
    card = probe(kernels=device(torch.bfloat16, mul=OPS.ftz_mul), ops=["mul"])
    assert card.get("mul", "subnormals") == "flushed"


def test_truncating_cast():
    card = probe(kernels=device(torch.float32, cast=OPS.trunc_cast), ops=["cast"])
    assert card.get("cast:fp32->bf16", "rounding") == "toward-zero"
    assert card.get("cast:fp32->bf16", "overflow") == "saturate"  # IEEE: toward zero never overflows
    # not planted: torch's casts
    assert card.get("cast:fp32->fp16", "rounding") == "nearest-even"
    assert card.get("cast:fp32->fp16", "overflow") == "inf"
    assert card.get("cast:fp32->bf16", "subnormals") == "kept"


@pytest.mark.parametrize("family", ["gemm", "sum"])
def test_a_failing_kernel_is_a_finding_not_a_crash(family):
    def broken(*args):
        raise RuntimeError("no kernel for this dtype\nsecond line")

    card = probe(kernels=device(torch.bfloat16, **{family: broken}), ops=[family])
    finding = card.finding(family, "accumulator_bits")
    assert finding.value == "error"
    assert finding.detail == "RuntimeError: no kernel for this dtype"
