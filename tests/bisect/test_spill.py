"""The captured step within a host-memory budget (precisiondiff/bisect/spill.py)."""
from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.bisect import bisect
from precisiondiff.bisect.spill import SpillSink

from . import planted

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.bool]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=8),
       st.integers(0, 200))
def test_tensors_read_back_bit_for_bit_and_memory_stays_within_the_budget(specs, budget):
    sink = SpillSink(budget)
    tensors = {}
    for i, (dtype, shape) in enumerate(specs):
        t = (torch.randn(shape) * 100).to(dtype) if dtype.is_floating_point else torch.randint(0, 2, shape).to(dtype)
        tensors[f"k{i}"] = t
        sink.write_event({"seq": i}, {f"k{i}": t})
    assert sink.held_bytes <= budget
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert sink.held_bytes + sink.spilled_bytes == total
    for key, t in tensors.items():
        back = sink.tensor({"data_key": key})
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    directory = sink._dir
    sink.cleanup()
    assert directory is None or not os.path.exists(directory)


def test_a_step_beyond_the_budget_is_spilled_and_the_verdict_stays():
    r = bisect(planted.softmax_workload, target="cpu/bf16", max_host_memory=16 << 10)
    c = r.culprit
    assert (c["kind"], c["scope"], c["name"], c["direction"]) == ("op", "1", "pdtest.fused_softmax.default", "forward")
    memory = r.cost["host_memory"]
    assert memory["held_bytes"] <= 16 << 10 < memory["held_bytes"] + memory["spilled_bytes"]
