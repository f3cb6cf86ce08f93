"""The parts of PyTorch real models use, under capture: complex dtypes, meta/fake tensors and
subclasses, inference mode, activation checkpointing, torch.compile, capture's own errors and
bookkeeping, and the host-memory bound."""
from __future__ import annotations

import errno
import json
import warnings

import pytest
import torch
from torch import nn

import precisiondiff
import precisiondiff.store as store
from precisiondiff.capture import MemorySink
from precisiondiff.capture.session import CaptureWarning
from precisiondiff.errors import PrecisionDiffError


class FFTLayer(nn.Module):
    """A spectral layer: complex128 intermediates on a float64 model."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8).double()

    def forward(self, x):
        spec = torch.fft.rfft(self.proj(x), dim=-1)
        return torch.fft.irfft(spec * spec.conj(), n=8, dim=-1)


def _events(path):
    return [json.loads(line) for line in (path / "index.jsonl").read_text().splitlines()]


def test_complex128_is_measured_never_crashes(tmp_path):
    model = FFTLayer()
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    with precisiondiff.capture(tmp_path / "d", model=model, mode="tensors") as cap:
        model(x).sum().backward()
    assert not cap.errors
    events = _events(tmp_path / "d")
    rfft = next(e for e in events if e["name"] == "aten._fft_r2c.default")
    out = next(t for t in rfft["tensors"] if t["slot"] == "output.0")
    assert out["dtype"] == "complex128" and out["data_key"] is None and out["not_stored"]
    spec = torch.fft.rfft(model.proj(x.detach()), dim=-1)
    parts = torch.view_as_real(spec)  # statistics over real and imaginary parts
    assert out["stats"]["max"] == parts.max().item() and out["stats"]["min"] == parts.min().item()
    assert out["stats"]["fingerprint"] == store.fingerprint(parts)
    assert store.verify(tmp_path / "d").ok


def test_meta_and_fake_tensors_are_named_not_measured():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = nn.Linear(4, 4)
    x = torch.randn(2, 4, device="meta")
    sink = MemorySink()
    with precisiondiff.capture(model=model, sink=sink) as cap:
        model(x)
    assert not cap.errors
    records = [t for e in sink.events for t in e["tensors"]]
    assert records and all(t["skipped"] == "meta tensor" and t["stats"] is None for t in records)

    with FakeTensorMode() as fake:
        fmodel = nn.Linear(4, 4)
        fx = fake.from_tensor(torch.randn(2, 4))
    sink = MemorySink()
    with precisiondiff.capture(model=fmodel, sink=sink, level="module") as cap:
        fmodel(fx)
    assert not cap.errors
    records = [t for e in sink.events for t in e["tensors"]]
    assert records and all(t["skipped"] == "fake tensor" for t in records)


def test_a_wrapper_subclass_is_skipped_not_crashed_on():
    from torch.testing._internal.two_tensor import TwoTensor

    sink = MemorySink()
    model = nn.ReLU()
    x = TwoTensor(torch.randn(3), torch.randn(3))
    with precisiondiff.capture(model=model, sink=sink, level="module") as cap:
        y = model(x)
    assert isinstance(y, TwoTensor) and not cap.errors
    assert {t["skipped"] for e in sink.events for t in e["tensors"]} == {"tensor subclass TwoTensor"}


def test_inference_mode_records_what_an_inplace_relu_produced():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
    sink = MemorySink()
    with torch.inference_mode(), precisiondiff.capture(model=model, sink=sink, level="module",
                                                       mode="tensors") as cap:
        y = model(torch.randn(16, 8))
    relu = next(e for e in sink.events if e["name"] == "ReLU")
    rec = {t["slot"]: t for t in relu["tensors"]}
    assert rec["input.0"]["stats"]["min"] < 0  # before the in-place ReLU
    assert rec["output.0"]["stats"]["min"] == 0.0 and rec["output.0"]["stats"]["max"] == y.max().item()
    assert torch.equal(sink.tensor(rec["output.0"]), y)
    assert not cap.errors


class TwoPaths(nn.Module):
    """The input reaches the module's output along two edges: its grad_input is their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) * self.b(x)


def _backward_ops(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), TwoPaths())
    sink = MemorySink()
    with precisiondiff.capture(model=model, sink=sink, level=level):
        model(torch.randn(2, 4)).sum().backward()
    return sorted((e["scope"], e["name"]) for e in sink.events if e["kind"] == "op" and e["direction"] == "backward")


def test_capture_bookkeeping_is_not_recorded():
    # level "op" installs no module backward hooks; "all" adds them (and sums grad_input's
    # edges itself): the model's backward ops must be the same
    assert _backward_ops("all") == _backward_ops("op")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head = Block(), nn.Linear(8, 2)
        self.checkpointed = checkpointed

    def forward(self, x):
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint
            h = checkpoint(self.block, x, use_reentrant=False)
        else:
            h = self.block(x)
        return self.head(h)


def _capture_net(checkpointed):
    model = Net(checkpointed)
    sink = MemorySink()
    with precisiondiff.capture(model=model, sink=sink, mode="tensors") as cap:
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert not cap.errors
    return sink


def test_activation_checkpointing_is_attributed_like_the_plain_model():
    plain, ckpt = _capture_net(False), _capture_net(True)

    def shape(sink):
        return sorted((e["kind"], e["scope"], e["name"], e["direction"], e["call"]) for e in sink.events)

    assert shape(ckpt) == shape(plain)  # no duplicated module calls, no recompute as backward
    fc1 = [e for e in ckpt.events if e["scope"] == "block.fc1" and e["direction"] == "backward"
           and e["kind"] == "op"]
    assert fc1, "the recomputed graph's backward ops keep their module's scope"

    def grads(sink):
        return {t["key"]: t["stats"]["fingerprint"] for e in sink.events if e["kind"] == "param"
                for t in e["tensors"]}
    assert grads(ckpt) == grads(plain)


def test_a_compiled_model_is_refused_in_one_line(tmp_path):
    model = torch.compile(nn.Linear(4, 4), backend="eager")
    with pytest.raises(PrecisionDiffError, match="compiled with torch.compile") as info:
        with precisiondiff.capture(tmp_path / "d", model=model):
            pass
    assert "\n" not in str(info.value)
    outer = nn.Sequential(torch.compile(nn.Linear(4, 4), backend="eager"))
    with pytest.raises(PrecisionDiffError, match="^0 is compiled"):
        with precisiondiff.capture(tmp_path / "e", model=outer):
            pass


def test_a_statistics_error_never_reaches_the_workload(tmp_path, monkeypatch):
    from precisiondiff.capture import stats

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    calls = {"n": 0}
    real = stats.StatsBatch.add

    def failing(self, t, **kw):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("planted statistics failure")
        return real(self, t, **kw)

    monkeypatch.setattr(stats.StatsBatch, "add", failing)
    x = torch.randn(2, 4)
    with pytest.warns(CaptureWarning, match="planted statistics failure"):
        with precisiondiff.capture(tmp_path / "d", model=model) as cap:
            y = model(x)
            y.sum().backward()
            cap.step()
    assert torch.equal(y, model(x))  # the workload ran to its end, unchanged
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["complete"] is False and "planted statistics failure" in meta["capture_errors"][0]
    assert store.verify(tmp_path / "d").ok


def test_a_full_disk_stops_the_writer_and_keeps_what_was_written(tmp_path, monkeypatch):
    import precisiondiff.store.writer as writer

    real = writer._save_safetensors
    calls = {"n": 0}

    def full(tensors, path):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path)

    monkeypatch.setattr(writer, "_save_safetensors", full)
    model = nn.Linear(4, 4)
    with pytest.warns(CaptureWarning, match="disk full") as record:
        with precisiondiff.capture(tmp_path / "d", model=model, mode="tensors") as cap:
            for _ in range(4):
                model(torch.randn(2, 4)).sum().backward()
                cap.step()
    assert len(record) == 1 and "\n" not in str(record[0].message)
    dump = store.load(tmp_path / "d")
    kept = list(dump.events())
    assert dump.complete is False and kept and {e.step for e in kept} == {0}
    assert all(torch.equal(dump.tensor(t.key), dump.tensor(t.key)) for e in kept for t in e.tensors)
    assert store.verify(tmp_path / "d").ok


def test_host_copies_are_bounded_by_bytes(monkeypatch):
    from precisiondiff.capture.recorder import Recorder

    peak = {"bytes": 0}
    real = Recorder.add

    def watch(self, *a, **kw):
        real(self, *a, **kw)
        peak["bytes"] = max(peak["bytes"], self._data_bytes)

    monkeypatch.setattr(Recorder, "add", watch)

    class Drop:
        def write_event(self, event, data):
            pass

        def close(self, complete=True):
            pass

    model = nn.Sequential(*[nn.ReLU() for _ in range(40)])  # 1 MiB activations, 80 recorded copies
    budget = 16 << 20
    with precisiondiff.capture(model=model, sink=Drop(), mode="tensors", level="module",
                               max_host_memory=budget):
        model(torch.randn(512, 512))
    assert 0 < peak["bytes"] <= budget // 4 + (1 << 20)
    with pytest.raises(PrecisionDiffError, match="too small"):
        precisiondiff.capture(model=model, sink=Drop(), max_host_memory=1000)


def test_warnings_as_errors_do_not_reach_the_workload(tmp_path, monkeypatch):
    from precisiondiff.capture import stats

    def failing(self, t, **kw):
        raise RuntimeError("planted")

    monkeypatch.setattr(stats.StatsBatch, "add", failing)
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with precisiondiff.capture(tmp_path / "d", model=model) as cap:
            model(torch.randn(2, 4))
    assert cap.errors


class Stream:
    """A stand-in accelerator stream: remembers the streams it was made to wait for."""

    def __init__(self, sid):
        self.stream_id, self.waited = sid, []

    def wait_stream(self, other):
        self.waited.append(other.stream_id)

    def __eq__(self, other):
        return self.stream_id == other.stream_id

    def __hash__(self):
        return self.stream_id


def test_read_back_waits_for_every_stream_tensors_were_recorded_on(monkeypatch):
    """Device-generic stream ordering, with a stand-in device module (no accelerator here)."""
    from precisiondiff.capture import streams

    side, default = Stream(7), Stream(0)
    state = {"current": side}

    class Module:
        @staticmethod
        def current_stream(device):
            return state["current"]

    monkeypatch.setattr(streams, "_module", lambda device: Module)
    noted = streams.StreamSet()
    dev = torch.device("cuda", 0)
    noted.note(dev)  # recorded while the user's side stream was current
    state["current"] = default
    noted.note(dev)
    noted.join()  # read back on the default stream
    assert default.waited == [7] and side.waited == []
    noted.join()
    assert default.waited == [7]  # forgotten after a join


def test_a_stream_already_noted_is_not_asked_for_again_but_a_new_one_is(monkeypatch):
    """With the backend's raw current-stream query (CUDA's), a tensor recorded on a stream already
    noted costs no Stream object; a switch of stream is still seen, and a join forgets both."""
    from precisiondiff.capture import streams

    side, default = Stream(7), Stream(0)
    state = {"current": side, "asked": 0}

    class Module:
        @staticmethod
        def current_stream(device):
            state["asked"] += 1
            return state["current"]

    monkeypatch.setattr(streams, "_module", lambda device: Module)
    monkeypatch.setattr(streams, "_raw_query", lambda kind: lambda index: 1000 + state["current"].stream_id)
    noted = streams.StreamSet()
    dev = torch.device("cuda", 0)
    for _ in range(5):
        noted.note(dev)
    assert state["asked"] == 1
    state["current"] = default
    noted.note(dev)
    noted.note(dev)
    assert state["asked"] == 2
    noted.join()  # asks once per noted stream
    assert default.waited == [7] and state["asked"] == 4
    state["current"] = side
    noted.note(dev)  # forgotten at the join: asked again
    assert state["asked"] == 5
    noted.join()
    assert default.waited == [7] and side.waited == []
