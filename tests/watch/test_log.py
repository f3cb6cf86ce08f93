"""The watch log: records round-trip, and a log cut at any byte keeps every whole line before it."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from precisiondiff.errors import PrecisionDiffError
from precisiondiff.watch.log import LOG_FILE, LogWriter, is_watch_log, read_log, read_logs

_floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
_records = st.lists(st.fixed_dictionaries({
    "loss": st.one_of(st.none(), _floats),
    "tensors": st.dictionaries(st.text(min_size=1, max_size=8), st.lists(_floats, min_size=7, max_size=7), max_size=3),
    "params": st.dictionaries(st.text(min_size=1, max_size=8), st.dictionaries(st.sampled_from(["weight", "grad"]),
                                                                                 _floats), max_size=3),
}), max_size=6)


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN == NaN as text


@settings(max_examples=40, deadline=None)
@given(records=_records, cut=st.floats(0, 1))
def test_a_log_cut_anywhere_reads_every_whole_step_before_the_cut(tmp_path_factory, records, cut):
    d = tmp_path_factory.mktemp("log")
    w = LogWriter(d, {"model": {"signature": "x"}})
    for i, r in enumerate(records):
        w.write({"step": i, **r})
    w.close(steps=len(records))
    whole = read_log(str(d / LOG_FILE))
    assert whole.complete and len(whole.steps) == len(records)
    assert all(_same(s, {"step": i, **r}) for i, (s, r) in enumerate(zip(whole.steps, records)))

    data = (d / LOG_FILE).read_bytes()
    header_end = data.index(b"\n") + 1
    at = header_end + int(cut * (len(data) - header_end))
    (d / LOG_FILE).write_bytes(data[:at])
    part = read_log(str(d / LOG_FILE))
    finished = data[:at].count(b"\n") - 1  # whole lines after the header
    assert len(part.steps) == min(finished, len(records))
    assert part.complete == (finished > len(records))
    assert part.torn_lines == (0 if at == len(data) or data[at - 1:at] == b"\n" else 1)


def test_an_existing_log_is_refused_unless_overwritten(tmp_path):
    LogWriter(tmp_path, {}).close(steps=0)
    with pytest.raises(PrecisionDiffError, match="exists"):
        LogWriter(tmp_path, {})
    LogWriter(tmp_path, {}, overwrite=True).close(steps=0)


def test_not_a_watch_log(tmp_path):
    assert not is_watch_log(tmp_path)
    with pytest.raises(PrecisionDiffError, match="holds no watch log"):
        read_logs(tmp_path)
    (tmp_path / LOG_FILE).write_text('{"format": "something else"}\n')
    with pytest.raises(PrecisionDiffError, match="not a precisiondiff watch log"):
        read_logs(tmp_path)


def test_rank_directories_are_one_log_per_rank(tmp_path):
    for rank in (0, 1):
        LogWriter(tmp_path / f"rank{rank}", {"rank": rank}).close(steps=0)
    assert is_watch_log(tmp_path)
    assert {r: lg.rank for r, lg in read_logs(tmp_path).items()} == {0: 0, 1: 1}
