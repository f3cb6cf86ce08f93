"""load / Dump: errors, lazy iteration, filters, stats mode, killed runs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from precisiondiff.errors import DumpError
from precisiondiff.store import DumpWriter, Event, load, verify
from precisiondiff.store.schema import INDEX

from .helpers import assert_bitwise_equal, op_event


def _write(path, n=3, **kw):
    with DumpWriter(path, meta={"target": "cpu/bf16"}, **kw) as w:
        for i in range(n):
            w.write_event(*op_event(i, [("output.0", torch.full((3,), float(i)))]))
    return path


def test_load_errors(tmp_path):
    with pytest.raises(DumpError, match="does not exist"):
        load(tmp_path / "missing")
    (tmp_path / "f").write_text("x")
    with pytest.raises(DumpError, match="is a file"):
        load(tmp_path / "f")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="not a precisiondiff dump"):
        load(tmp_path / "empty")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "meta.json").write_bytes(b"\x00{not json")
    with pytest.raises(DumpError, match="corrupted"):
        load(tmp_path / "garbage")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "meta.json").write_text('{"name": "something else"}')
    with pytest.raises(DumpError, match="no format_version"):
        load(tmp_path / "other")
    (tmp_path / "future").mkdir()
    (tmp_path / "future" / "meta.json").write_text('{"format_version": 99}')
    with pytest.raises(DumpError, match="upgrade precisiondiff"):
        load(tmp_path / "future")


def test_events_records_and_filters(tmp_path):
    path = tmp_path / "d"
    with DumpWriter(path, meta={}) as w:
        w.write_event(*op_event(0, [("output.0", torch.ones(2))], kind="module", name="Linear"))
        ev, data = op_event(1, [("grad_input.0", torch.ones(2))], step=1)
        ev["direction"] = "backward"
        w.write_event(ev, data)
        w.write_event(*op_event(2, [("output.0", torch.ones(2))], step=1))
    dump = load(path)
    assert dump.complete and dump.meta["format"] == "safetensors"
    events = list(dump.events())
    assert all(isinstance(e, Event) for e in events)
    assert [e.seq for e in events] == [0, 1, 2]
    assert [e.seq for e in dump.events(kind="op")] == [1, 2]
    assert [e.seq for e in dump.events(direction="backward")] == [1]
    assert [e.seq for e in dump.events(step=1, kind="op", direction="forward")] == [2]
    rec = dump.record(events[0].tensors[0].key)
    assert rec.has_data and rec.shape == (2,) and rec.dtype == "float32"
    assert rec.shard == "shard-00000.safetensors"
    assert len(list(dump.records())) == 3 and len(dump.keys()) == 3


def test_unknown_key_and_stats_mode(tmp_path):
    path = tmp_path / "d"
    with DumpWriter(path, meta={}) as w:
        w.write_event(*op_event(0, [("output.0", torch.ones(2))], stats_mode=True))
    dump = load(path)
    (rec,) = dump.records()
    assert not rec.has_data
    with pytest.raises(DumpError, match="stats mode: capture with --mode tensors"):
        dump.tensor(rec.key)
    with pytest.raises(DumpError, match="no tensor 'nope'"):
        dump.tensor("nope")


def test_reads_only_the_requested_tensor(tmp_path, monkeypatch):
    path = _write(tmp_path / "d", n=4)
    dump = load(path)
    keys = dump.keys()
    opened = []
    from precisiondiff.store import reader

    class Spy(reader.ShardFile):
        def __init__(self, path):
            opened.append(path)
            super().__init__(path)

    monkeypatch.setattr(reader, "ShardFile", Spy)
    for k in keys:
        dump.tensor(k)
    assert len(opened) == 1  # one shard, one cached open file (its header parsed once)
    assert_bitwise_equal(dump.tensor(keys[2]), torch.full((3,), 2.0))


def test_truncated_last_index_line_is_ignored(tmp_path, caplog):
    path = _write(tmp_path / "d")
    index = path / INDEX
    data = index.read_bytes()
    index.write_bytes(data + data.splitlines(keepends=True)[0][:25])
    assert [e.seq for e in load(path).events()] == [0, 1, 2]
    assert "truncated last line" in caplog.text


def test_garbled_middle_line_loses_that_event_only(tmp_path, caplog):
    path = _write(tmp_path / "d")
    before = [e.seq for e in load(path).events()]
    lines = (path / INDEX).read_bytes().splitlines(keepends=True)
    lines[1] = b"{garbage\n"
    (path / INDEX).write_bytes(b"".join(lines))
    with caplog.at_level("WARNING"):
        after = [e.seq for e in load(path).events()]
    assert after == before[:1] + before[2:]
    assert "line 2 is damaged" in caplog.text and "verify" in caplog.text
    from precisiondiff.store import verify
    assert not verify(path).ok


def test_missing_shard_raises_dump_error(tmp_path):
    path = _write(tmp_path / "d")
    dump = load(path)
    (path / "shard-00000.safetensors").unlink()
    with pytest.raises(DumpError, match="missing: the dump is damaged"):
        dump.tensor(dump.keys()[0])


def test_nothing_is_unpickled():
    import pathlib
    import re

    import precisiondiff.store as store

    for f in pathlib.Path(store.__file__).parent.glob("*.py"):
        src = f.read_text()
        assert not re.search(r"torch\.load\b|import pickle|pickle\.load|allow_pickle=True", src), f


_KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from precisiondiff.store import DumpWriter
    from store.helpers import op_event
    w = DumpWriter({path!r}, meta={{"target": "cpu/bf16"}}, shard_bytes=200)
    for i in range(40):
        w.write_event(*op_event(i, [("output.0", torch.full((10,), float(i)))]))
        if i == 19:
            w.flush()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_killed_run_leaves_a_readable_partial_dump(tmp_path):
    path = tmp_path / "d"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _KILLED.format(tests=tests, path=str(path))],
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL
    dump = load(path)
    assert dump.complete is False
    events = list(dump.events())
    assert 20 <= len(events) <= 40
    assert [e.seq for e in events] == list(range(len(events)))
    for ev in events:
        assert_bitwise_equal(dump.tensor(ev.tensors[0].key), torch.full((10,), float(ev.seq)))
    report = verify(path)
    assert report.ok, report.problems
    assert report.partial
    assert json.loads((path / "meta.json").read_text())["complete"] is False
