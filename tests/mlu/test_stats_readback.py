"""Statistics of device tensors reach the host through pinned memory, without blocking the host
when the copy is queued (StatsBatch.start); reading them waits for that copy only."""
from __future__ import annotations

import math

import torch

from precisiondiff.capture.stats import StatsBatch


def test_device_statistics_travel_through_pinned_memory_with_an_event():
    batch = StatsBatch()
    large, small = torch.randn(100_000).to("mlu"), torch.tensor([1.0, math.nan, 3.0]).to("mlu")
    handles = [batch.add(large), batch.add(small)]
    batch.start()
    (queued, stats, fps, done), = batch._inflight
    assert sorted(queued) == handles and stats.is_pinned() and fps.is_pinned()
    assert done is not None and done.device.type == "mlu"
    batch.resolve()
    got = [batch.get(h) for h in handles]
    reference = StatsBatch(fast=False)
    expected = [reference.add(t) for t in (large, small)]
    reference.resolve()  # the device's own float32 statistics, through the same copies
    assert [reference.get(h) for h in expected][0] == got[0]
    assert got[1]["nan"] == 1 and math.isnan(got[1]["mean"]) and got[1]["fingerprint"] == \
        reference.get(expected[1])["fingerprint"]
