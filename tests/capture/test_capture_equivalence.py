"""The optimised per-event path records exactly what the previous one did: the same events, the
same statistics to the last bit, the same stored tensors, the same dump index byte for byte.

The oracle is ``legacy_capture.py`` (the previous path's methods, frozen), swapped into the
session in place of the current ones; both capture the same real small models."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from precisiondiff.capture import MemorySink, capture
from precisiondiff.capture import session as session_mod
from precisiondiff.store.schema import INDEX

from .legacy_capture import LegacyRecorder


class _Block(nn.Module):
    """Attention and an MLP with what the per-event path special-cases: in-place ops, views,
    a parameter's transpose (strided), a negative view, int64 indices, an empty tensor."""

    def __init__(self, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Parameter(torch.randn(dim, 4 * dim) / 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        x = x + self.proj(self.drop(att @ v))
        h = torch.nn.functional.gelu(self.up(x))
        h.mul_(1.5)  # in place: the version counter changes under the same tensor
        x = x + h @ self.down.t()  # a strided parameter view
        x = x + torch._neg_view(x.detach()) * 0.0  # a negative view, read by its values
        _ = x.new_zeros(0) + 1.0  # an empty tensor
        return x.float().pow(2).mean()


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 32, (2, 6))


def _run(model: nn.Module, ids: torch.Tensor, dtype: torch.dtype, steps: int, **kw) -> MemorySink:
    sink = MemorySink()
    with capture(model=model, sink=sink, **kw) as cap:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(ids)
            loss.backward()
            with torch.no_grad():
                bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0], dtype=dtype)
                (bad * 2.0).sum()  # NaN and Inf counts; a 16-bit tensor outside autocast
            cap.step()
            model.zero_grad(set_to_none=True)
    return sink


def _both(monkeypatch, dtype, steps=2, **kw):
    torch.manual_seed(0)
    base = _Block().train(False)
    ids = _ids()
    new = _run(copy.deepcopy(base), ids, dtype, steps, **kw)
    with monkeypatch.context() as m:
        m.setattr(session_mod, "Recorder", LegacyRecorder)
        old = _run(copy.deepcopy(base), ids, dtype, steps, **kw)
    return new, old


def _same(new: MemorySink, old: MemorySink) -> None:
    assert len(new.events) == len(old.events) > 30
    for a, b in zip(new.events, old.events):
        assert repr(a) == repr(b)  # repr: floats to the last bit, NaN equal to NaN, key order
    assert new.data.keys() == old.data.keys()
    for key, t in new.data.items():
        u = old.data[key]
        assert (t.dtype, t.shape) == (u.dtype, u.shape)
        assert t.reshape(-1).view(torch.uint8).equal(u.reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["op", "module", "all"])
def test_stats_events_are_those_of_the_previous_path(monkeypatch, dtype, level):
    new, old = _both(monkeypatch, dtype, level=level, mode="stats")
    _same(new, old)
    stats = [t["stats"] for e in new.events for t in e["tensors"] if t["stats"]]
    if level != "module":  # the op outside the model reads NaN and Inf
        assert any(s["nan"] for s in stats) and any(s["inf"] for s in stats)


@pytest.mark.parametrize("mode", ["tensors", "replay"])
def test_stored_tensors_are_those_of_the_previous_path(monkeypatch, mode):
    new, old = _both(monkeypatch, torch.bfloat16, level="all", mode=mode)
    _same(new, old)
    assert new.data


def test_a_dump_index_is_the_previous_paths_byte_for_byte(monkeypatch, tmp_path):
    torch.manual_seed(0)
    base = _Block().train(False)
    ids = _ids()
    index = []
    for name, recorder in (("new", session_mod.Recorder), ("old", LegacyRecorder)):
        with monkeypatch.context() as m:
            m.setattr(session_mod, "Recorder", recorder)
            model = copy.deepcopy(base)
            with capture(tmp_path / name, model=model, level="all", mode="stats"):
                model(ids).backward()
        index.append((tmp_path / name / INDEX).read_bytes())
    assert index[0] == index[1] and index[0].count(b"\n") > 50
