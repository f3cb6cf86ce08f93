"""The peer rule measured a block of elements at a time gives the one-pass verdict, bit for bit."""
import json
import math

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from precisiondiff.comparators import error_stats, peers
from precisiondiff.comparators.error_stats import DetSum, det_sum

LOW = [torch.bfloat16, torch.float16, torch.float32]


def _toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded toward zero to ``dtype`` (a planted wrong kernel: the bias test's case): where
    rounding to nearest went up in magnitude, one step back (the bit pattern's magnitude minus 1)."""
    r = x.to(dtype)
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    return torch.where(r.double().abs() > x.abs(), (r.view(bits) - 1).view(dtype), r)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 700), seed=st.integers(0, 2**31), dtype=st.sampled_from(LOW),
       block=st.integers(1, 300), det_block=st.sampled_from([4, 8, 4096]),
       defect=st.sampled_from(["none", "noise", "toward_zero", "sparse"]),
       peer_set=st.sampled_from([(), ("float32",), ("float32", "decomposition")]),
       with_magnitude=st.booleans(), partial_sums=st.booleans(), zeros=st.booleans(), flushed=st.booleans(),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([math.nan, math.inf, -math.inf]),
                                   st.sampled_from(["dut", "golden", "float32"])), max_size=3))
def test_the_rule_in_blocks_is_the_rule_in_one_pass(n, seed, dtype, block, det_block, defect, peer_set,
                                                    with_magnitude, partial_sums, zeros, flushed, specials):
    """Every figure of the verdict (norms, maxima, floor, bias, RMSE and its paired z, tail, N_eff,
    flushed subnormals, NaN/Inf) and its message are the same whatever the blocks, including
    blocks that split ``det_sum``'s 4096-element rows (a tiny row forces many carries)."""
    gen = torch.Generator().manual_seed(seed)
    golden = torch.randn(n, generator=gen, dtype=torch.float64)
    if zeros:
        golden[torch.rand(n, generator=gen) < 0.3] = 0.0
    if flushed:  # subnormal in the DUT dtype, returned as zero by the kernel
        golden[: n // 3] = float(torch.finfo(dtype).smallest_normal) / 4
    dut = {"none": lambda: golden.to(dtype),
           "noise": lambda: (golden * (1 + 2.0 ** -7 * torch.randn(n, generator=gen, dtype=torch.float64))).to(dtype),
           "toward_zero": lambda: _toward_zero(golden, dtype),
           "sparse": lambda: torch.where(torch.arange(n) % 97 == 3, golden * 1.05, golden).to(dtype)}[defect]()
    if flushed:
        dut[: n // 6] = 0
    peer_values = {"float32": golden.to(dtype),
                   "decomposition": (golden * (1 + 2.0 ** -9 * torch.randn(n, generator=gen,
                                                                           dtype=torch.float64))).to(dtype)}
    ps = {name: peer_values[name] for name in peer_set}
    tensors = {"dut": dut, "golden": golden, "float32": ps.get("float32")}
    for at, value, where in specials:
        if tensors[where] is not None:
            tensors[where][at % n] = value
    kwargs = dict(partial_sums=partial_sums)
    if with_magnitude:
        kwargs.update(magnitude=golden.abs() * 8 + 0.01, k=256)
    whole, blocked = _whole_and_blocked(dut, golden, ps, block, det_block, **kwargs)
    assert json.dumps(blocked.as_dict()) == json.dumps(whole.as_dict())
    assert (blocked.passed, blocked.message, blocked.notes) == (whole.passed, whole.message, whole.notes)


def _whole_and_blocked(dut, golden, ps, block, det_block=4096, **kwargs):
    saved = peers.JUDGE_BLOCK_ELEMENTS, error_stats._BLOCK
    try:
        error_stats._BLOCK = det_block
        peers.JUDGE_BLOCK_ELEMENTS = 1 << 40
        whole = peers.judge_against_peers(dut, golden, ps, **kwargs)
        peers.JUDGE_BLOCK_ELEMENTS = block
        return whole, peers.judge_against_peers(dut, golden, ps, **kwargs)
    finally:
        peers.JUDGE_BLOCK_ELEMENTS, error_stats._BLOCK = saved


def test_the_statistics_in_blocks_measure_small_elements_by_the_used_elements_rms():
    """The statistics' element ULP below the significance threshold is that of the RMS over the
    elements they use (flushed subnormals left out), not over all: here the two thresholds lie in
    different binades (RMS^2 0.24 over all, 0.26 over the used), and the blocked figures follow."""
    golden = torch.zeros(1000, dtype=torch.float64)
    golden[:240] = 1.0
    golden[240:400] = float(torch.finfo(torch.bfloat16).smallest_normal) / 3
    dut = golden.bfloat16()
    dut[240:317] = 0  # 77 flushed: 1000 - 77 used
    whole, blocked = _whole_and_blocked(dut, golden, {}, 64, 16)
    assert whole.stats["flushed"] == 77
    assert json.dumps(blocked.as_dict()) == json.dumps(whole.as_dict())
    used = golden[torch.cat([torch.arange(240), torch.arange(317, 1000)])]
    assert used.pow(2).mean() > 0.25 > golden.pow(2).mean()  # the case is one where the RMS matters


def test_a_planted_bias_in_a_large_output_fails_in_blocks():
    """An output above the block size with every element rounded toward zero fails the bias test,
    judged a block at a time (the planted defect the peer rule's size tests let through)."""
    n = peers.JUDGE_BLOCK_ELEMENTS + 12345
    golden = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    verdict = peers.judge_against_peers(_toward_zero(golden, torch.bfloat16), golden, {"float32": golden.bfloat16()})
    assert not verdict.passed
    assert "toward zero" in verdict.message
    assert verdict.stats["n"] == n
    assert peers.judge_against_peers(golden.bfloat16(), golden, {"float32": golden.bfloat16()}).passed


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), max_size=8), det_block=st.sampled_from([1, 3, 4, 16]),
       seed=st.integers(0, 2**31))
def test_a_sum_fed_in_pieces_is_the_sum_of_the_whole(sizes, det_block, seed):
    """``DetSum`` over pieces in order equals ``det_sum`` of their concatenation, bit for bit, and
    counts its elements."""
    gen = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(s, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-5, 5, (1,), generator=gen).item()
              for s in sizes]
    saved = error_stats._BLOCK
    try:
        error_stats._BLOCK = det_block
        acc = DetSum()
        for p in pieces:
            acc.add(p)
        whole = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
        assert acc.value() == det_sum(whole)
        assert acc.count == whole.numel()
    finally:
        error_stats._BLOCK = saved


def test_a_sum_fed_in_pieces_at_the_real_row_length():
    """At the real 4096-element rows, pieces that straddle rows (the carry) give ``det_sum``'s value."""
    x = torch.randn(3 * 4096 + 777, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    acc = DetSum()
    for lo in range(0, x.numel(), 1000):
        acc.add(x[lo:lo + 1000])
    assert acc.value() == det_sum(x)
