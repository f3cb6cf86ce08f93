"""Capture's lean per-event path: batched hand-off, the last-tensor shortcut, Dynamo kept out of
the dispatch mode, and a killed capture that never fsynced still leaving its finished steps."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import precisiondiff.store as store
from precisiondiff.capture import MemorySink, capture
from precisiondiff.store.fingerprint import fingerprint


class _CountingSink(MemorySink):
    def __init__(self) -> None:
        super().__init__()
        self.batches = []

    def write_events(self, items) -> None:
        self.batches.append(len(items))
        super().write_events(items)


def test_events_reach_the_sink_in_batches_in_order():
    sink = _CountingSink()
    x = torch.randn(8)
    # the Python engine's batches (the compiled engine hands its events over 256 at a time)
    with capture(level="op", mode="stats", sink=sink, engine="python") as cap:
        cap.recorder.batch_events = 16
        for _ in range(40):
            x = torch.sin(x)
    assert sum(sink.batches) == len(sink.events) == 40
    assert max(sink.batches) == 16 and len(sink.batches) == 3  # 16 + 16 + the rest at exit
    assert [e["seq"] for e in sink.events] == list(range(40))
    assert [e["call"] for e in sink.events] == list(range(40))


def _stats_of(sink, name, slot):
    return [t["stats"] for e in sink.events if e["name"] == name for t in e["tensors"] if t["slot"] == slot]


def test_a_tensor_changed_in_place_is_measured_again():
    """The previous op's output is recorded as the next input without a lookup only while unchanged."""
    sink = MemorySink()
    y = torch.linspace(-1, 1, 16)
    with capture(level="op", mode="stats", sink=sink) as cap:
        x = torch.sin(y)
        with cap.suspended():
            before = x.clone()
            x.add_(10.0)  # not recorded: only its version counter tells
        x * 2.0
        x * 3.0  # the same, unchanged x again
    (sin_out,) = _stats_of(sink, "aten.sin.default", "output.0")
    assert sin_out["fingerprint"] == fingerprint(before)
    mul_in, mul_in_again = _stats_of(sink, "aten.mul.Tensor", "input.0")
    assert mul_in["fingerprint"] == fingerprint(x) == mul_in_again["fingerprint"]
    assert mul_in["max"] == float(x.max()) and mul_in["max"] > 10


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_a_negative_view_of_recorded_memory_is_measured_by_its_values(engine):
    """A negative view shares its memory, shape, strides and version with the tensor it views:
    its values are the opposite. It is measured as itself, not de-duplicated to that tensor's
    record (the compiled engine, which does not de-duplicate, showed the difference)."""
    sink = MemorySink()
    y = torch.linspace(-1, 3, 16)
    with capture(level="op", mode="stats", sink=sink, engine=engine):
        x = torch.sin(y)
        torch._neg_view(x) * 1.0  # resolved below autograd by a clone the mode records
    (sin_out,) = _stats_of(sink, "aten.sin.default", "output.0")
    (neg_in,) = _stats_of(sink, "aten.clone.default", "input.0")
    assert sin_out["max"] == float(x.max()) and neg_in["max"] == float((-x).max()) != sin_out["max"]
    assert neg_in["fingerprint"] == fingerprint(-x)


def test_a_conjugate_view_of_recorded_memory_is_measured_by_its_values():
    sink = MemorySink()
    z = torch.complex(torch.linspace(-1, 1, 8), torch.linspace(0.5, 2, 8))
    with capture(level="op", mode="stats", sink=sink):
        w = z * 1.0
        w.conj() * 1.0  # resolved below autograd by a clone the mode records
    w_out = _stats_of(sink, "aten.mul.Tensor", "output.0")[0]
    (conj_in,) = _stats_of(sink, "aten.clone.default", "input.0")
    assert w_out["min"] == float(torch.view_as_real(w).min()) == -1.0  # the real parts'
    assert conj_in["min"] == float(torch.view_as_real(w.conj().resolve_conj()).min()) == -2.0  # -imag


def test_the_last_tensor_shortcut_keeps_the_data_key_in_tensors_mode():
    sink = MemorySink()
    y = torch.randn(4)
    with capture(level="op", mode="tensors", sink=sink):
        x = torch.sin(y)
        torch.cos(x)
    sin, cos = sink.events
    (out,) = [t for t in sin["tensors"] if t["slot"] == "output.0"]
    (inp,) = [t for t in cos["tensors"] if t["slot"] == "input.0"]
    assert inp["data_key"] == out["data_key"] == out["key"]  # stored once, aliased
    assert torch.equal(sink.data[inp["data_key"]], x)


def test_a_compiled_function_under_op_capture_runs_without_warnings():
    """Dynamo neither compiles nor inlines the dispatch mode (no torch._disable_dynamo wrapper
    per op any more): no graph-break warning, the result is right, the ops are recorded."""
    def f(x):
        return torch.sin(x) * 2 + 1

    compiled = torch.compile(f, backend="eager")
    x = torch.randn(8)
    sink = MemorySink()
    with capture(level="op", mode="stats", sink=sink) as cap:
        got = compiled(x)  # filterwarnings=error: any warning fails the test
    assert torch.equal(got, f(x))
    assert not cap.errors and {e["name"] for e in sink.events} >= {"aten.sin.default"}


def test_module_level_statistics_are_unchanged_by_the_hook_fast_paths():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    sink = MemorySink()
    with capture(model=model, level="module", mode="stats", sink=sink):
        model(x).square().mean().backward()
    fwd = {e["scope"]: e for e in sink.events if e["kind"] == "module" and e["direction"] == "forward"}
    with torch.no_grad():
        out = model(x)
    (rec,) = [t for t in fwd[""]["tensors"] if t["slot"] == "output.0"]
    assert rec["stats"]["max"] == float(out.max()) and rec["stats"]["fingerprint"] == fingerprint(out)
    bwd = [e for e in sink.events if e["kind"] == "module" and e["direction"] == "backward"]
    assert {e["scope"] for e in bwd} == {"", "0", "1", "2"}
    assert all(any(t["slot"].startswith("grad_output") for t in e["tensors"]) for e in bwd)


SCRIPT = """
import os, signal, sys, torch
import precisiondiff
x = torch.randn(16)
with precisiondiff.capture(sys.argv[1], level="op", mode="tensors") as cap:
    for step in range(3):
        for _ in range(5):
            x = torch.sin(x)
        cap.step()
    for _ in range(3):
        x = torch.cos(x)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_capture_keeps_every_finished_step_without_fsync(tmp_path):
    """fsync runs only at close; a process killed before keeps everything it wrote."""
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "dump"
    r = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    dump = store.load(out)
    assert dump.complete is False
    events = list(dump.events())
    assert [e.step for e in events] == [0] * 5 + [1] * 5 + [2] * 5
    for e in events:
        for t in e.tensors:
            assert dump.tensor(t.key).shape == (16,)
    report = store.verify(out)
    assert report.ok and report.partial


def test_durable_capture_fsyncs_every_step_and_the_default_only_at_close(tmp_path, monkeypatch):
    import os
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    counts = {}
    for durable in (False, True):
        calls.clear()
        x = torch.randn(8)
        with capture(tmp_path / f"d{durable}", level="op", mode="tensors", durable=durable) as cap:
            for _ in range(2):
                x = torch.sin(x)
                cap.step()
            counts[durable] = len(calls)  # before close
        assert store.load(tmp_path / f"d{durable}").complete
        assert len(calls) > counts[durable]  # close always syncs
    assert counts[False] == 0 and counts[True] >= 2


def test_a_sink_overriding_write_event_still_sees_every_event():
    """Batches go through write_event for MemorySink subclasses (bisect's spilling sink is one)."""
    class Seen(MemorySink):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def write_event(self, event, data):
            self.seen += 1
            super().write_event(event, data)

    sink = Seen()
    x = torch.randn(4)
    with capture(level="op", mode="tensors", sink=sink):
        for _ in range(5):
            x = torch.cos(x)
    assert sink.seen == len(sink.events) == 5 and len(sink.data) == 6


@pytest.mark.parametrize("flag", [[], ["--durable"]])
def test_cli_durable_flag_reaches_the_writer(tmp_path, monkeypatch, flag):
    """``capture --durable`` fsyncs while the capture runs; without it only close does."""
    import os
    from click.testing import CliRunner
    from precisiondiff.cli import cli
    from precisiondiff.store import writer as writer_mod
    seen = []
    real_init = writer_mod.DumpWriter.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("durable", False))
        real_init(self, *args, **kwargs)
    monkeypatch.setattr(writer_mod.DumpWriter, "__init__", spy)
    out = tmp_path / "d"
    res = CliRunner().invoke(cli, ["capture", "examples/tiny_transformer.py:build", "-o", str(out),
                                   "--target", "cpu/bf16", "--level", "module", *flag])
    assert res.exit_code == 0, res.output
    assert seen == [bool(flag)]
    assert store.load(out).complete and os.path.isdir(out)


def test_the_dedup_windows_unindexed_list_stays_bounded_when_memory_is_reused():
    """Freed memory reused by a new tensor of the same layout gives an identity equal to an
    evicted one: pruning must drop the repeats, or the list stays long and is rebuilt at every
    add (O(window) each). What a later write forgets is unchanged (test_a_tensor_changed_in_place_is_measured_again)."""
    from precisiondiff.capture.recorder import Recorder
    rec = Recorder(MemorySink(), dedup_window=8)
    event = rec.begin("op", "", "x", "forward")
    buffers = [torch.zeros(16) for _ in range(9)]  # one more than the window: each is evicted, then seen again
    prunes, length = 0, 0
    for i in range(400):
        rec.add(event, "output.0", buffers[i % 9].view(16))  # a new tensor, the same identity
        prunes += len(rec._unindexed) < length
        length = len(rec._unindexed)
    assert len(rec._seen) <= 8 and length <= 4 * 8 + 1
    assert prunes <= 400 // (3 * 8) + 1  # pruned to what the window holds, not just under the bound


def test_capture_freezes_the_heap_only_while_it_runs_and_only_if_nobody_else_did():
    import gc
    assert gc.get_freeze_count() == 0
    with capture(level="op", mode="stats", sink=MemorySink()):
        assert gc.get_freeze_count() > 0  # what was alive before is out of the collector's scans
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with capture(level="op", mode="stats", sink=MemorySink()):
            pass
        assert gc.get_freeze_count() == frozen  # the program's own freeze is left alone
    finally:
        gc.unfreeze()
