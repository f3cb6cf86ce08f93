"""verify: precise problems for damage; partial dumps and orphans are notes, not damage."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from precisiondiff.store import DumpWriter, fingerprint, load, verify
from precisiondiff.store.schema import INDEX

from .helpers import op_event


def _write(path, fmt="safetensors", n=3, fp=True):
    with DumpWriter(path, format=fmt, meta={}, shard_bytes=1) as w:
        for i in range(n):
            t = torch.full((4,), float(i))
            ev, data = op_event(i, [("output.0", t)])
            if fp:
                ev["tensors"][0]["stats"]["fingerprint"] = fingerprint(t)
            w.write_event(ev, data)
    return path


@pytest.mark.parametrize("fmt", ["safetensors", "h5"])
def test_sound_dump_is_ok(tmp_path, fmt):
    report = verify(_write(tmp_path / "d", fmt))
    assert report.ok and not report.partial and report.problems == [] and report.notes == []
    assert report.summary["events"] == 3 and report.summary["fingerprints"] == 3
    assert report.summary["checked"] == 3
    assert "ok" in str(report)


def test_truncated_shard(tmp_path):
    path = _write(tmp_path / "d")
    shard = path / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    report = verify(path)
    assert not report.ok
    (problem,) = report.problems
    assert problem.startswith("shard-00001.safetensors: cannot be opened")
    assert "event seq 1" in problem and "blocks.0/aten.mm.default#1:forward:output.0" in problem


def test_deleted_shard(tmp_path):
    path = _write(tmp_path / "d")
    (path / "shard-00002.safetensors").unlink()
    report = verify(path)
    assert not report.ok
    assert report.problems == [
        "shard-00002.safetensors: missing, referenced by index.jsonl line 3 (event seq 2), "
        "key 'blocks.0/aten.mm.default#2:forward:output.0'"]


def test_garbled_index_line(tmp_path):
    path = _write(tmp_path / "d")
    lines = (path / INDEX).read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:40] + b"\n"
    (path / INDEX).write_bytes(b"".join(lines))
    report = verify(path)
    assert not report.ok
    (problem,) = report.problems
    assert problem.startswith("index.jsonl line 2: not a valid event")
    # the orphaned shard of the lost line is a note
    assert any(n.startswith("shard-00001.safetensors: not referenced") for n in report.notes)


def test_changed_data_fails_the_fingerprint(tmp_path):
    path = _write(tmp_path / "d")
    shard = path / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01  # flip one bit of the last element
    shard.write_bytes(bytes(raw))
    report = verify(path)
    (problem,) = report.problems
    assert "event seq 0" in problem and "content fingerprint" in problem
    assert verify(path, fingerprints=False).ok


def test_dtype_or_shape_mismatch(tmp_path):
    path = _write(tmp_path / "d", fp=False)
    lines = [json.loads(x) for x in (path / INDEX).read_text().splitlines()]
    lines[0]["tensors"][0]["shape"] = [2, 2]
    lines[1]["tensors"][0]["dtype"] = "float16"
    (path / INDEX).write_text("".join(json.dumps(x) + "\n" for x in lines))
    problems = verify(path).problems
    assert len(problems) == 2
    assert "event seq 0" in problems[0] and "float32[4], the index says float32[2, 2]" in problems[0]
    assert "event seq 1" in problems[1] and "the index says float16[4]" in problems[1]


def test_missing_data_key_in_shard(tmp_path):
    path = _write(tmp_path / "d", fp=False)
    lines = [json.loads(x) for x in (path / INDEX).read_text().splitlines()]
    lines[2]["tensors"][0]["data_key"] = "nope"
    (path / INDEX).write_text("".join(json.dumps(x) + "\n" for x in lines))
    (problem,) = verify(path).problems
    assert "event seq 2" in problem and "has no data 'nope'" in problem


def test_duplicate_keys(tmp_path):
    path = _write(tmp_path / "d", fp=False)
    lines = (path / INDEX).read_text().splitlines(keepends=True)
    dup = json.loads(lines[0])
    dup["seq"] = 3
    (path / INDEX).write_text("".join(lines) + json.dumps(dup) + "\n")
    (problem,) = verify(path).problems
    assert "line 4 (event seq 3)" in problem and "duplicate key, first recorded at line 1" in problem


def test_partial_and_orphans_are_notes(tmp_path):
    path = _write(tmp_path / "d", fp=False)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps(dict(meta, complete=False)))
    shutil.copy(path / "shard-00000.safetensors", path / "shard-00007.safetensors")
    (path / "shard-00008.safetensors.tmp").write_bytes(b"half")
    with open(path / INDEX, "ab") as fh:
        fh.write(b'{"seq":3,"kin')  # killed while appending
    report = verify(path)
    assert report.ok and report.partial
    text = " | ".join(report.notes)
    assert "partial dump" in text and "shard-00007.safetensors: not referenced" in text
    assert "shard-00008.safetensors.tmp: temporary file" in text
    assert "truncated last line" in text
    assert len(list(load(path).events())) == 3


def test_bad_meta_is_a_problem(tmp_path):
    path = _write(tmp_path / "d", fp=False)
    (path / "meta.json").write_text("{")
    report = verify(path)
    assert not report.ok and "meta.json is corrupted" in report.problems[0]
    report = verify(tmp_path / "nothing")
    assert not report.ok


def test_multi_rank_problems_name_the_rank(tmp_path):
    for rank in (0, 1):
        with DumpWriter(tmp_path, meta={"world_size": 2, "rank": rank}) as w:
            w.write_event(*op_event(0, [("output.0", torch.ones(2))]))
    (tmp_path / "rank1" / "shard-00000.safetensors").unlink()
    report = verify(tmp_path)
    (problem,) = report.problems
    assert problem.startswith("rank1: shard-00000.safetensors: missing")
    assert report.summary["events"] == 2


def test_h5_missing_and_garbage_file(tmp_path):
    path = _write(tmp_path / "d", "h5")
    (path / "data.h5").write_bytes(b"not hdf5")
    report = verify(path)
    assert not report.ok
    assert report.problems[0].startswith("data.h5: cannot be opened")
    (path / "data.h5").unlink()
    report = verify(path)
    assert report.problems[0].startswith("data.h5: missing, referenced by index.jsonl line 1")
    assert len(report.problems) == 3  # one line per record whose data is gone
