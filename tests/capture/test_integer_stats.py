"""Small integer and bool CPU tensors (token ids, masks) are measured by NumPy at once: the same
record, to the last bit, as the batched PyTorch path gives them, alone or in a batch."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.capture import stats as stats_mod


def _records(monkeypatch, tensors, fast: bool) -> list:
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(stats_mod, "_integer_stats", lambda *a: None)
        batch = stats_mod.StatsBatch()
        handles = [batch.add(t) for t in tensors]
        batch.resolve()
        return [repr(batch.get(h)) for h in handles]  # repr: every float to the last bit, key order


def _tensors(dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(7)
    found = [torch.zeros(3, dtype=dtype), torch.ones(1, dtype=dtype)]
    for size in (1, 5, 32, 999, 65536):
        if dtype == torch.bool:
            t = torch.randint(0, 2, (size,), generator=g).bool()
            found += [t, t[::3]]
            continue
        info = torch.iinfo(dtype)
        for top in (2, 128, 50_000, 2**20, 2**31 - 1):
            top = min(top, info.max)
            t = torch.randint(max(-top, info.min), top, (size,), generator=g, dtype=dtype)
            found += [t, t[::2], t.reshape(1, -1).t()]
    return found


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.bool])
def test_integer_records_are_the_batched_paths(monkeypatch, dtype):
    tensors = _tensors(dtype)
    assert _records(monkeypatch, tensors, True) == _records(monkeypatch, tensors, False)
    for t in tensors[:12]:
        assert _records(monkeypatch, [t], True) == _records(monkeypatch, [t], False)


def test_values_whose_sums_would_round_take_the_batched_path(monkeypatch):
    big = torch.tensor([2**62, -(2**63), 3, 2**40])
    assert stats_mod._integer_stats(big, big.numel()) is None
    assert _records(monkeypatch, [big], True) == _records(monkeypatch, [big], False)
    ids = torch.randint(0, 50_000, (4, 512))
    record, squares = stats_mod._integer_stats(ids, ids.numel())
    assert squares == float((ids.double() ** 2).sum()) and record["norm"] is None
