"""DumpWriter: layout, golden bytes, atomicity, aliases, ranks, back-pressure, errors."""
from __future__ import annotations

import errno
import json
import os
import struct
import threading
import time

import pytest
import torch

import precisiondiff.store.writer as writer_mod
from precisiondiff.errors import DumpError
from precisiondiff.store import FORMAT_VERSION, DumpWriter, load, verify

from .helpers import assert_bitwise_equal, op_event, record


def _read_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_golden_bytes_bf16_fp16(tmp_path):
    bf16 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    fp16 = torch.tensor([1.0, -2.0], dtype=torch.float16)
    event = {"seq": 0, "step": 0, "rank": 0, "kind": "op", "scope": "", "name": "aten.add.Tensor",
             "direction": "forward", "call": 0, "device": "cpu",
             "tensors": [record("/aten.add.Tensor#0:forward:input.0", bf16, slot="input.0"),
                         record("/aten.add.Tensor#0:forward:output.0", fp16)],
             "args": None}
    with DumpWriter(tmp_path / "d", meta={"target": "cpu/bf16"}) as w:
        w.write_event(event, {"/aten.add.Tensor#0:forward:input.0": bf16,
                              "/aten.add.Tensor#0:forward:output.0": fp16})
    header, data = _read_safetensors(tmp_path / "d" / "shard-00000.safetensors")
    a = header["/aten.add.Tensor#0:forward:input.0"]
    b = header["/aten.add.Tensor#0:forward:output.0"]
    assert (a["dtype"], a["shape"], b["dtype"], b["shape"]) == ("BF16", [3], "F16", [2])
    got = {k: data[v["data_offsets"][0]:v["data_offsets"][1]]
           for k, v in header.items() if k != "__metadata__"}
    # bf16 1.0=0x3F80 -2.0=0xC000 0.5=0x3F00; fp16 1.0=0x3C00 -2.0=0xC000; little-endian
    assert got["/aten.add.Tensor#0:forward:input.0"] == bytes.fromhex("803f00c0003f")
    assert got["/aten.add.Tensor#0:forward:output.0"] == bytes.fromhex("003c00c0")
    assert len(data) == max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    line = (tmp_path / "d" / "index.jsonl").read_text()
    assert line == (
        '{"seq":0,"step":0,"rank":0,"kind":"op","scope":"","name":"aten.add.Tensor",'
        '"direction":"forward","call":0,"device":"cpu","tensors":['
        '{"key":"/aten.add.Tensor#0:forward:input.0","slot":"input.0","dtype":"bfloat16",'
        '"shape":[3],"stats":{},"data_key":"/aten.add.Tensor#0:forward:input.0",'
        '"shard":"shard-00000.safetensors"},'
        '{"key":"/aten.add.Tensor#0:forward:output.0","slot":"output.0","dtype":"float16",'
        '"shape":[2],"stats":{},"data_key":"/aten.add.Tensor#0:forward:output.0",'
        '"shard":"shard-00000.safetensors"}],"args":null}\n')


def test_meta_on_open_and_close(tmp_path):
    w = DumpWriter(tmp_path / "d", meta={"target": "cpu/bf16", "seed": 0})
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["complete"] is False and meta["format_version"] == FORMAT_VERSION
    assert meta["format"] == "safetensors" and meta["target"] == "cpu/bf16" and meta["created"]
    w.write_event(*op_event(0, [("output.0", torch.ones(4))]))
    w.write_event(*op_event(1, [("output.0", torch.ones(2))], stats_mode=True))
    w.close()
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["complete"] is True
    assert (meta["events"], meta["tensors"], meta["bytes"]) == (2, 2, 16)
    assert not list((tmp_path / "d").glob("*.tmp"))
    w.close()  # idempotent


def test_index_follows_shards_and_flush(tmp_path):
    w = DumpWriter(tmp_path / "d", meta={}, shard_bytes=1 << 20)
    w.write_event(*op_event(0, [("output.0", torch.ones(4))]))
    w.write_event(*op_event(1, [("output.0", torch.ones(2))], stats_mode=True))
    deadline = time.monotonic() + 5  # wait for the writer thread to take both events
    while not w._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.001)
    # the shard is not full: neither event may be indexed yet (order = execution order)
    assert (tmp_path / "d" / "index.jsonl").read_text() == ""
    assert not list((tmp_path / "d").glob("shard-*"))
    w.flush()
    lines = (tmp_path / "d" / "index.jsonl").read_text().splitlines()
    assert [json.loads(x)["seq"] for x in lines] == [0, 1]
    assert w.events_written == 2
    w.close()


def test_stats_only_events_are_indexed_without_flush(tmp_path):
    w = DumpWriter(tmp_path / "d", meta={})
    w.write_event(*op_event(0, [("output.0", torch.ones(4))], stats_mode=True))
    deadline = time.monotonic() + 5
    while w.events_written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.events_written == 1
    w.close()


def test_context_manager_exception_marks_partial(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with DumpWriter(tmp_path / "d", meta={}) as w:
            w.write_event(*op_event(0, [("output.0", torch.arange(3.0))]))
            raise RuntimeError("boom")
    dump = load(tmp_path / "d")
    assert dump.complete is False
    assert_bitwise_equal(dump.tensor(next(dump.records()).key), torch.arange(3.0))


def test_refuses_existing_dump_unless_overwrite(tmp_path):
    DumpWriter(tmp_path / "d", meta={}).close()
    with pytest.raises(DumpError, match="already holds a dump"):
        DumpWriter(tmp_path / "d", meta={})
    w = DumpWriter(tmp_path / "d", meta={"x": 1}, overwrite=True)
    w.close()
    assert load(tmp_path / "d").meta["x"] == 1


def test_cannot_create_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DumpError, match="a file with that name exists"):
        DumpWriter(tmp_path / "file", meta={})
    with pytest.raises(DumpError, match="cannot create dump directory"):
        DumpWriter(tmp_path / "file" / "sub", meta={})


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        with pytest.raises(DumpError, match="ro"):
            DumpWriter(tmp_path / "ro" / "d", meta={})
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="format"):
        DumpWriter(tmp_path / "d", format="npz", meta={})
    w = DumpWriter(tmp_path / "e", meta={})
    with pytest.raises(ValueError, match="never|no event"):
        ev, _ = op_event(0, [("output.0", torch.ones(1))])
        w.write_event(ev, {})
    with pytest.raises(DumpError, match="complex128"):
        w.write_event(*op_event(1, [("output.0", torch.ones(1, dtype=torch.complex128))]))
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write_event(*op_event(2, [("output.0", torch.ones(1))]))


def test_aliases_store_bytes_once(tmp_path):
    t = torch.arange(1000, dtype=torch.float32)
    for fmt in ("safetensors", "h5"):
        path = tmp_path / fmt
        with DumpWriter(path, format=fmt, meta={}) as w:
            ev0, data0 = op_event(0, [("output.0", t)], name="aten.relu.default")
            key0 = ev0["tensors"][0]["key"]
            w.write_event(ev0, data0)
            # the next op's input is the same tensor: a record pointing at key0, no new data
            ev1, _ = op_event(1, [("input.0", t)], name="aten.exp.default")
            ev1["tensors"][0]["data_key"] = key0
            w.write_event(ev1, {})
            # the same data passed again is not stored twice either
            ev2, _ = op_event(2, [("input.0", t)], name="aten.neg.default")
            ev2["tensors"][0]["data_key"] = key0
            w.write_event(ev2, {key0: t})
        if fmt == "safetensors":
            (shard,) = path.glob("shard-*")
            assert 4000 < shard.stat().st_size < 4000 + 4000  # one copy of the 4000 bytes
        else:
            import h5py

            with h5py.File(path / "data.h5", "r") as f:
                assert list(f) == [key0.replace("/", "%2F")]
        dump = load(path)
        recs = list(dump.records())
        assert [r.is_alias for r in recs] == [False, True, True]
        for r in recs:
            assert_bitwise_equal(dump.tensor(r.key), t)
        assert json.loads((path / "meta.json").read_text())["bytes"] == 4000
        dump.close()


def test_shared_storage_views_are_stored(tmp_path):
    base = torch.arange(12.0)
    views = {"a": base[:6], "b": base[6:], "c": base.view(3, 4), "d": base.view(3, 4)[:, 1]}
    with DumpWriter(tmp_path / "d", meta={}) as w:
        for i, (slot, t) in enumerate(views.items()):
            w.write_event(*op_event(i, [(slot, t)]))
    dump = load(tmp_path / "d")
    for rec, t in zip(dump.records(), views.values()):
        assert_bitwise_equal(dump.tensor(rec.key), t)


def test_multi_rank_layout_and_merge(tmp_path):
    for rank in (0, 1):
        with DumpWriter(tmp_path, meta={"world_size": 2, "rank": rank}) as w:
            ev, data = op_event(0, [("output.0", torch.full((2,), float(rank)))])
            ev["rank"] = rank
            w.write_event(ev, data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    dump = load(tmp_path)
    assert sorted(dump.ranks) == [0, 1] and dump.complete and dump.meta["world_size"] == 2
    assert [e.rank for e in dump.events()] == [0, 1]
    key = next(dump.ranks[1].records()).key
    assert_bitwise_equal(dump.tensor(f"rank1/{key}"), torch.full((2,), 1.0))
    assert_bitwise_equal(dump.tensor(key, rank=0), torch.full((2,), 0.0))
    with pytest.raises(DumpError, match="name one"):
        dump.tensor(key)
    assert verify(tmp_path).ok


def test_back_pressure_blocks_the_caller(tmp_path, monkeypatch):
    gate = threading.Event()
    real = writer_mod._save_safetensors

    def slow_save(tensors, path):
        gate.wait(10)
        real(tensors, path)

    monkeypatch.setattr(writer_mod, "_save_safetensors", slow_save)
    w = DumpWriter(tmp_path / "d", meta={}, shard_bytes=1, queue_bytes=100)
    w.write_event(*op_event(0, [("output.0", torch.ones(16))]))  # 64 bytes: in the writer
    second = threading.Thread(target=w.write_event,
                              args=op_event(1, [("output.0", torch.ones(16))]))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "write_event should block while 64+64 > queue_bytes"
    gate.set()
    second.join(10)
    assert not second.is_alive()
    w.close()
    assert len(list(load(tmp_path / "d").events())) == 2


def test_disk_full_keeps_what_was_written(tmp_path, monkeypatch):
    real = writer_mod._save_safetensors
    calls = []

    def save(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as fh:  # a half-written temporary file, as a full disk leaves
                fh.write(b"\x00" * 10)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(tensors, path)

    monkeypatch.setattr(writer_mod, "_save_safetensors", save)
    path = tmp_path / "d"
    w = DumpWriter(path, meta={}, shard_bytes=1)
    w.write_event(*op_event(0, [("output.0", torch.arange(4.0))]))
    w.flush()
    w.write_event(*op_event(1, [("output.0", torch.arange(5.0))]))
    with pytest.raises(DumpError, match=r"disk full while writing .*kept 1 events already "
                                        r"written .*No space left on device.*free space"):
        w.flush()
    with pytest.raises(DumpError, match="disk full"):
        w.write_event(*op_event(2, [("output.0", torch.ones(1))]))
    with pytest.raises(DumpError, match="disk full"):
        w.close()
    assert sorted(p.name for p in path.iterdir()) == ["index.jsonl", "meta.json",
                                                      "shard-00000.safetensors"]
    dump = load(path)
    assert dump.complete is False
    (ev,) = list(dump.events())
    assert_bitwise_equal(dump.tensor(ev.tensors[0].key), torch.arange(4.0))
    report = verify(path)
    assert report.ok and report.partial


def test_disk_full_inside_context_manager_does_not_hide_the_error(tmp_path, monkeypatch):
    def save(tensors, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_mod, "_save_safetensors", save)
    with pytest.raises(DumpError, match="kept 0 events"):
        with DumpWriter(tmp_path / "d", meta={}, shard_bytes=1) as w:
            w.write_event(*op_event(0, [("output.0", torch.ones(2))]))
            w.flush()
    assert load(tmp_path / "d").complete is False


def test_other_os_errors_are_dump_errors(tmp_path, monkeypatch):
    def save(tensors, path):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(writer_mod, "_save_safetensors", save)
    w = DumpWriter(tmp_path / "d", meta={}, shard_bytes=1)
    w.write_event(*op_event(0, [("output.0", torch.ones(2))]))
    with pytest.raises(DumpError, match="Input/output error"):
        w.close()
