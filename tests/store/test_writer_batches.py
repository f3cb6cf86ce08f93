"""DumpWriter's fast path: batched hand-off, index lines (orjson or json), fsync only at close."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import precisiondiff.store.writer as writer_mod
from precisiondiff.store import DumpWriter, load, verify
from precisiondiff.store import lines as lines_mod
from precisiondiff.store.schema import canonical_event, encode_line

from .helpers import assert_bitwise_equal, op_event


def _events(n, stats_mode=False):
    return [op_event(i, [("input.0", torch.arange(float(i + 1))), ("output.0", torch.full((3,), i * 0.5))],
                     stats_mode=stats_mode) for i in range(n)]


def test_a_batch_writes_the_same_dump_as_one_event_at_a_time(tmp_path):
    with DumpWriter(tmp_path / "one", meta={}) as w:
        for ev, data in _events(5):
            w.write_event(ev, data)
    with DumpWriter(tmp_path / "batch", meta={}) as w:
        items = _events(5)
        w.write_events(items[:2])
        w.write_events(items[2:])
    one = (tmp_path / "one" / "index.jsonl").read_text().splitlines()
    batch = (tmp_path / "batch" / "index.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in one] == [json.loads(x) for x in batch]
    dump = load(tmp_path / "batch")
    assert dump.complete and [e.seq for e in dump.events()] == list(range(5))
    for ev in dump.events():
        assert_bitwise_equal(dump.tensor(ev.tensors[1].key), torch.full((3,), ev.seq * 0.5))
    assert verify(tmp_path / "batch").ok


def test_a_batch_with_a_dangling_data_key_queues_nothing(tmp_path):
    w = DumpWriter(tmp_path / "d", meta={})
    good, bad = _events(2)
    bad[0]["tensors"][0]["data_key"] = "never/written"
    with pytest.raises(ValueError, match="no event has written"):
        w.write_events([good, bad])
    w.write_events([good])  # an alias to a tensor of the same batch is fine
    w.close()
    assert [e.seq for e in load(tmp_path / "d").events()] == [0]


def test_seq_defaults_to_submission_order_across_batches(tmp_path):
    items = _events(4, stats_mode=True)
    for ev, _ in items:
        ev["seq"] = None
    with DumpWriter(tmp_path / "d", meta={}) as w:
        w.write_events(items[:3])
        w.write_event(*items[3])
    assert [e.seq for e in load(tmp_path / "d").events()] == [0, 1, 2, 3]


def test_nan_and_inf_statistics_keep_their_json_spelling(tmp_path):
    ev, _ = op_event(0, [("output.0", torch.ones(2))], stats_mode=True)
    ev["tensors"][0]["stats"] = {"min": math.nan, "max": math.inf, "mean": -math.inf, "nan": 1}
    ok, _ = op_event(1, [("output.0", torch.ones(2))], stats_mode=True)
    ok["tensors"][0]["stats"] = {"min": 1e-05, "max": 1.5e300, "mean": 0.1, "nan": 0}
    with DumpWriter(tmp_path / "d", meta={}) as w:
        w.write_events([(ev, {}), (ok, {})])
    text = (tmp_path / "d" / "index.jsonl").read_text()
    assert '"min":NaN,"max":Infinity,"mean":-Infinity' in text
    stats = [e.tensors[0].stats for e in load(tmp_path / "d").events()]
    assert math.isnan(stats[0]["min"]) and stats[0]["max"] == math.inf and stats[0]["mean"] == -math.inf
    assert stats[1] == {"min": 1e-05, "max": 1.5e300, "mean": 0.1, "nan": 0}


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(stats=st.dictionaries(st.text(max_size=6), _json_values, max_size=5), args=_json_values,
       use_orjson=st.booleans())
def test_encode_reads_back_as_the_reference_encoding(stats, args, use_orjson):
    ev, _ = op_event(0, [("output.0", torch.ones(1))], stats_mode=True)
    ev["tensors"][0]["stats"] = stats
    ev["args"] = args
    line = lines_mod.canonical(ev, {"seq": 0})
    got = lines_mod.encode(line, use_orjson=use_orjson)
    want = encode_line(canonical_event(ev))
    assert b"\n" not in got
    # same values, NaN included (compared through their text, as NaN != NaN)
    assert json.dumps(json.loads(got)) == json.dumps(json.loads(want))


def test_tensors_and_numpy_scalars_in_an_event_take_the_general_encoder(tmp_path):
    ev, _ = op_event(0, [("output.0", torch.ones(1))], stats_mode=True)
    ev["tensors"][0]["stats"] = {"min": torch.tensor(0.5), "count": torch.tensor([1, 2]).numpy()[1],
                                 "dtype": torch.bfloat16}
    with DumpWriter(tmp_path / "d", meta={}) as w:
        w.write_event(ev, {})
    (got,) = load(tmp_path / "d").events()
    assert got.tensors[0].stats == {"min": 0.5, "count": 2, "dtype": "bfloat16"}


def _count_fsyncs(monkeypatch):
    calls = []
    real = os.fsync

    def fsync(fd):
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.mark.parametrize("durable", [False, True])
def test_fsync_once_at_close_unless_durable(tmp_path, monkeypatch, durable):
    calls = _count_fsyncs(monkeypatch)
    w = DumpWriter(tmp_path / "d", meta={}, shard_bytes=8, durable=durable)
    for step in range(3):
        w.write_events([op_event(2 * step + i, [("output.0", torch.full((2,), float(i)))])
                        for i in range(2)])
        w.flush()  # a step's end: the step is in the files
        assert len(list(load(tmp_path / "d").events())) == 2 * (step + 1)
    during = len(calls)
    w.close()
    if durable:
        assert during >= 3 * 2  # each step: its shards and its index lines
    else:
        assert during == 0
        assert len(calls) >= 3  # at close: the index, the shards, meta.json
    assert load(tmp_path / "d").complete and verify(tmp_path / "d").ok


def test_written_steps_are_readable_before_close(tmp_path):
    """What a killed process leaves: every flushed step is in the files, without any fsync."""
    w = DumpWriter(tmp_path / "d", meta={}, shard_bytes=1 << 20)
    w.write_events(_events(3))
    w.flush()
    dump = load(tmp_path / "d")
    assert dump.complete is False and [e.seq for e in dump.events()] == [0, 1, 2]
    assert_bitwise_equal(dump.tensor(next(iter(dump.events())).tensors[0].key), torch.arange(1.0))
    report = verify(tmp_path / "d")
    assert report.ok and report.partial
    w.close()


def test_the_general_encoder_without_orjson(tmp_path, monkeypatch):
    monkeypatch.setattr(lines_mod, "_orjson", None)
    with DumpWriter(tmp_path / "d", meta={}) as w:
        w.write_events(_events(2))
    assert [e.seq for e in load(tmp_path / "d").events()] == [0, 1]
    assert writer_mod.encode is lines_mod.encode


class _FullDisk:
    """An index file whose second write finds the disk full."""

    def __init__(self, fh):
        self.fh, self.writes = fh, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 2:
            import errno
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)


def test_disk_full_on_the_index_of_a_statistics_dump(tmp_path):
    """No writer thread for events without data: the error reaches the caller at once, one line."""
    from precisiondiff.errors import DumpError
    w = DumpWriter(tmp_path / "d", meta={})
    w._index = _FullDisk(w._index)
    first, second = _events(2, stats_mode=True)
    w.write_events([first])
    with pytest.raises(DumpError, match=r"^disk full while writing .*kept 1 events already written") as err:
        w.write_events([second])
    assert "\n" not in str(err.value)
    with pytest.raises(DumpError, match="disk full"):
        w.close()
    dump = load(tmp_path / "d")
    assert dump.complete is False and [e.seq for e in dump.events()] == [0]
    assert verify(tmp_path / "d").ok


def test_a_statistics_dump_starts_no_thread_and_a_tensor_starts_one(tmp_path):
    w = DumpWriter(tmp_path / "d", meta={})
    w.write_events(_events(2, stats_mode=True))
    w.flush()
    assert w._thread is None and len(list(load(tmp_path / "d").events())) == 2
    ev, data = op_event(2, [("output.0", torch.ones(3))])
    w.write_event(ev, data)
    assert w._thread is not None
    w.write_events([op_event(3, [("output.0", torch.ones(1))], stats_mode=True)])  # queued behind it
    w.close()
    assert [e.seq for e in load(tmp_path / "d").events()] == [0, 1, 2, 3]
