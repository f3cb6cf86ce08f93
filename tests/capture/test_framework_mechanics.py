"""What real framework jobs (torchtitan, FSDP2, DeepSpeed, transformers) meet under capture:
complex RoPE tables moved to a target, higher-order operators (flex_attention, cond), buffers an
op fills without reading them, and weights re-initialised in place between two uses."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

import precisiondiff
import precisiondiff.store as store
from precisiondiff import Workload
from precisiondiff.bisect import bisect_dump
from precisiondiff.capture import MemorySink
from precisiondiff.capture.runner import capture_script, capture_workload
from precisiondiff.compare.scan import scan
from precisiondiff.runtime.targets import Target
from precisiondiff.store.notes import meta_notes

HERE = "tests.capture.test_framework_mechanics"


def _unseen(fn):
    """Run ``fn`` where no dispatch mode sees it: what the workload's memory holds without an op
    capture could observe (garbage in memory ``torch.empty`` returned)."""
    with torch._C._DisableTorchDispatch():
        return fn()


def _slot(ev, slot):
    return next((t for t in ev["tensors"] if t["slot"] == slot), None)


def _ops(sink, name):
    return [e for e in sink.events if e["kind"] == "op" and e["name"] == name]


# -- complex parameters, buffers and inputs ---------------------------------------------------

class Rotary(nn.Module):
    """torchtitan's RoPE: a complex64 ``freqs_cis`` buffer from torch.polar, applied through
    view_as_complex."""

    def __init__(self, seq: int = 8, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        q = self.proj(x)
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        return torch.view_as_real(qc * self.freqs_cis).flatten(-2).type_as(q)


def rotary_workload() -> Workload:
    return Workload(Rotary(), torch.randn(2, 8, 8), loss=lambda y: y.pow(2).mean())


@pytest.mark.parametrize("target, expected", [("cpu/bf16", torch.complex64), ("cpu/fp16", torch.complex64),
                                              ("cpu/fp32", torch.complex64), ("cpu/float64", torch.complex128),
                                              ("cpu/bf16+autocast", torch.complex64)])
def test_complex_buffers_keep_a_complex_dtype_of_the_targets_precision(target, expected):
    model = Rotary()
    moved = Target.parse(target).prepare_model(model)
    assert moved.freqs_cis.dtype == expected
    # nothing of the imaginary part is lost (complex64 -> complex128 is exact)
    assert torch.equal(moved.freqs_cis.to(torch.complex128), model.freqs_cis.to(torch.complex128))
    assert moved.proj.weight.dtype == (torch.float32 if target.endswith("autocast") else Target.parse(target).dtype)
    assert model.freqs_cis.dtype == torch.complex64  # the user's model is untouched


def test_complex_inputs_follow_the_target_and_the_rotation_is_the_users():
    x = torch.randn(2, 8, 8)
    z = torch.randn(3, dtype=torch.complex64)
    assert Target.parse("cpu/float64").prepare_inputs(z).dtype == torch.complex128
    assert Target.parse("cpu/bf16").prepare_inputs(z).dtype == torch.complex64
    assert Target.parse("cpu/bf16").prepare_inputs({"z": z, "i": torch.arange(3)})["i"].dtype == torch.int64
    model = Rotary()
    ref = Target.parse("cpu/float64")
    got = ref.prepare_model(model)(ref.prepare_inputs(x))
    expected = model.double()(x.double())  # the same rotation computed on the user's own model
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_rope_workload_is_captured_with_its_complex_table(tmp_path):
    capture_workload(f"{HERE}:rotary_workload", tmp_path / "d", target="cpu/bf16", mode="tensors")
    dump = store.load(tmp_path / "d")
    mul = next(ev for ev in dump.events() if ev.name == "aten.mul.Tensor" and ev.direction == "forward")
    assert sorted(t.dtype for t in mul.tensors if t.slot.startswith("input")) == ["complex64", "complex64"]
    assert dump.meta["observer_effect"]["bitwise_equal"] is True


# -- higher-order operators -------------------------------------------------------------------

class FlexCond(nn.Module):
    """FlexAttention (a HOP in eager) and torch.cond (a HOP) in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention
        q, k, v = (t.reshape(1, 4, 2, 4).transpose(1, 2) for t in self.qkv(x).split(8, dim=-1))
        o = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5)
        y = o.transpose(1, 2).reshape(4, 8)
        return torch.cond(y.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (y,))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("level", ["op", "all"])
@pytest.mark.parametrize("mode", ["stats", "tensors", "replay"])
def test_higher_order_operators_are_recorded_as_units(level, mode):
    torch.manual_seed(0)
    model, x = FlexCond(), torch.randn(4, 8)
    with torch.no_grad():  # FlexAttention has no backward on the CPU
        plain = model(x)
        sink = MemorySink()
        with precisiondiff.capture(sink=sink, model=model, level=level, mode=mode) as cap:
            out = model(x)
    assert not cap.errors
    assert torch.equal(out, plain)  # capture changed nothing
    for name, n_out in (("higher_order.flex_attention", 1), ("higher_order.cond", 1)):
        (ev,) = _ops(sink, name)
        slots = [t["slot"] for t in ev["tensors"]]
        assert "input.0" in slots and len([s for s in slots if s.startswith("output")]) >= n_out
        if mode == "replay":
            assert ev["args"]["replayable"] is False  # its subgraphs are code, not data
    (flex,) = _ops(sink, "higher_order.flex_attention")
    if mode != "stats":
        o = sink.tensor(_slot(flex, "output.0"))
        assert o.shape == (1, 2, 4, 4) and torch.isfinite(o).all()
    (cond,) = _ops(sink, "higher_order.cond")
    assert _slot(cond, "output.0")["stats"]["max"] == pytest.approx(out.max().item())


@pytest.mark.parametrize("mode", ["stats", "replay"])
def test_while_loop_is_recorded_as_one_unit(mode):
    from torch._higher_order_ops.while_loop import while_loop
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def run():
        with torch.no_grad():
            return while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, lin(h).tanh()), (torch.tensor(0), x))

    plain = run()
    sink = MemorySink()
    with precisiondiff.capture(sink=sink, model=lin, level="op", mode=mode) as cap:
        captured = run()
    assert not cap.errors
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
    (ev,) = _ops(sink, "higher_order.while_loop")
    assert _slot(ev, "output.1")["stats"]["max"] == captured[1].max().item()


# Dynamo's own variable builder reads .grad of a non-leaf while compiling cond's wrapper
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_cond_backward_under_capture_and_the_note_in_the_dump(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def step():
        y = lin(x)
        # a branch calling a hooked module: Dynamo traces it (capture's hooks stand aside)
        out = torch.cond(y.sum() > 0, lambda a: lin(a).sin(), lambda a: a.cos(), (y,))
        out.sum().backward()
        grad, lin.weight.grad = lin.weight.grad.clone(), None
        return out.detach(), grad

    plain = step()
    with precisiondiff.capture(tmp_path / "d", model=lin, level="all", mode="tensors") as cap:
        captured = step()
    assert not cap.errors
    assert torch.equal(plain[0], captured[0]) and torch.equal(plain[1], captured[1])
    dump = store.load(tmp_path / "d")
    names = {(ev.name, ev.direction) for ev in dump.events()}
    assert ("higher_order.cond", "forward") in names and ("higher_order.cond", "backward") in names
    assert dump.meta["higher_order_ops"]["higher_order.cond"]["calls"] == 2
    assert any("higher_order.cond" in n and "one unit" in n for n in meta_notes(dump.meta))


# -- write-only arguments ---------------------------------------------------------------------

def test_out_arguments_of_any_name_are_outputs_never_inputs():
    x = torch.randn(4, 5)
    sink = MemorySink()
    with precisiondiff.capture(sink=sink, level="op", mode="replay") as cap:
        values, indices = torch.empty(5), torch.empty(5, dtype=torch.long)
        _unseen(lambda: values.fill_(float("nan")))
        torch.max(x, 0, out=(values, indices))  # schema: max.dim_max(..., *, max, max_values)
        buf = torch.empty(4, 5)
        _unseen(lambda: buf.fill_(float("nan")))
        torch.add(x, 1.0, out=buf)
    assert not cap.errors
    (ev,) = _ops(sink, "aten.max.dim_max")
    assert [t["slot"] for t in ev["tensors"]] == ["input.0", "output.0", "output.1"]
    assert _slot(ev, "output.0")["stats"]["nan"] == 0
    (add,) = _ops(sink, "aten.add.out")
    assert [t["slot"] for t in add["tensors"]] == ["input.0", "output.0"]


class CopyIn(nn.Module):
    """FSDP2's all-gather copy-in: shards copied into one rank's slice of a fresh buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - registers fsdp ops
        shards = [self.a.weight.reshape(-1), self.b.weight.reshape(-1)]
        numel = sum(s.numel() for s in shards)
        buf = torch.empty(2 * numel, dtype=shards[0].dtype)
        _unseen(lambda: buf.fill_(float("nan")))  # what uninitialized memory may hold
        mine, whole = torch.ops.fsdp.all_gather_copy_in(shards, buf, [s.numel() for s in shards], numel, 0)
        w = mine[: self.a.weight.numel()].view_as(self.a.weight)
        return self.b(torch.nn.functional.linear(x, w, self.a.bias))


def copy_in_workload() -> Workload:
    return Workload(CopyIn(), torch.randn(5, 4))


def test_an_uninitialized_buffer_an_op_fills_is_not_an_input_and_scan_finds_no_nan(tmp_path):
    capture_workload(f"{HERE}:copy_in_workload", tmp_path / "d", target="cpu/bf16", mode="replay")
    dump = store.load(tmp_path / "d")
    (ev,) = [e for e in dump.events() if e.name == "fsdp.all_gather_copy_in.default"]
    slots = {t.slot: t for t in ev.tensors}
    assert sorted(s for s in slots if s.startswith("input")) == ["input.0", "input.1"]  # the two shards
    assert slots["output.0"].stats["nan"] == 0 and slots["output.0"].has_data
    assert not slots["output.1"].has_data and not slots["output.1"].stats
    raw = next(json.loads(line) for line in (tmp_path / "d" / "index.jsonl").read_text().splitlines()
               if '"fsdp.all_gather_copy_in.default"' in line)
    assert "uninitialized" in _slot(raw, "output.1")["skipped"]
    assert ev.args["args"][1] == {"like": {"dtype": "bfloat16", "shape": [36]}}  # replay allocates it
    assert scan(tmp_path / "d").first("nonfinite") is None
    result = bisect_dump(tmp_path / "d", ref="cpu/float64", workload=f"{HERE}:copy_in_workload")
    assert result.verdict == "parity", result.culprit


# -- in-place re-initialisation between two uses ----------------------------------------------

class Reinit(nn.Module):
    """A weight used, re-initialised in place (with no_grad, and through ``.data`` as
    transformers' and DeepSpeed's older code does), used again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []  # what each use of the weight read

    def forward(self, x):
        gen = torch.Generator().manual_seed(1)
        _unseen(lambda: self.seen.append(self.lin.weight.detach().clone()))
        a = self.lin(x)
        with torch.no_grad():
            self.lin.weight.normal_(generator=gen)
        _unseen(lambda: self.seen.append(self.lin.weight.detach().clone()))
        b = self.lin(a)
        self.lin.weight.data.normal_(generator=gen)  # no version counter sees this write
        _unseen(lambda: self.seen.append(self.lin.weight.detach().clone()))
        return self.lin(b)


def reinit_workload() -> Workload:
    return Workload(Reinit(), torch.randn(3, 4))


@pytest.mark.parametrize("level", ["op", "all"])
def test_a_recorded_input_is_what_the_op_read_after_an_in_place_reinit(level):
    model, x = Reinit(), torch.randn(3, 4)
    sink = MemorySink()
    with precisiondiff.capture(sink=sink, model=model, level=level, mode="tensors") as cap:
        model(x)
    assert not cap.errors
    mms = _ops(sink, "aten.addmm.default")
    assert len(mms) == 3
    for ev, weight in zip(mms, model.seen):
        assert torch.equal(sink.tensor(_slot(ev, "input.2")), weight.t())


def test_workload_capture_records_the_reinitialised_weight_and_bisect_finds_parity(tmp_path):
    spec = f"{HERE}:reinit_workload"
    capture_workload(spec, tmp_path / "d", target="cpu/bf16", mode="replay")
    dump = store.load(tmp_path / "d")
    mms = [ev for ev in dump.events() if ev.name == "aten.addmm.default"]
    weights = [ev for ev in dump.events() if ev.kind == "module" and ev.scope == "lin"]
    assert len(mms) == 3 and len(weights) == 3
    for mm, mod in zip(mms, weights):  # each use read the weight its module call holds
        assert torch.equal(dump.tensor(next(t.key for t in mm.tensors if t.slot == "input.2")),
                           dump.tensor(next(t.key for t in mod.tensors if t.slot == "param.weight")).t())
    assert len({dump.tensor(next(t.key for t in mod.tensors if t.slot == "param.weight")).sum().item()
                for mod in weights}) == 3  # three different weights
    result = bisect_dump(tmp_path / "d", ref="cpu/float64", workload=spec)
    assert result.verdict == "parity", result.culprit


def test_script_capture_records_the_reinitialised_weight(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('os').getcwd())!r})
        from {HERE} import Reinit
        torch.manual_seed(0)
        model = Reinit()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        torch.save(model.seen, {str(tmp_path / 'seen.pt')!r})
    """))
    capture_script(str(script), [], tmp_path / "d", level="all", mode="tensors")
    seen = torch.load(tmp_path / "seen.pt", weights_only=True)
    dump = store.load(tmp_path / "d")
    mms = [ev for ev in dump.events() if ev.name == "aten.addmm.default" and ev.direction == "forward"]
    assert len(mms) == 3
    for ev, weight in zip(mms, seen):
        assert torch.equal(dump.tensor(next(t.key for t in ev.tensors if t.slot == "input.2")), weight.t())
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["complete"] is True


def test_a_tensor_whose_memory_is_swapped_is_measured_afresh():
    # Module._apply and ZeRO's flat buffers do ``t.data = other``: same tensor, same version
    # counter, other memory
    x, other = torch.randn(4, 4), torch.full((4, 4), 3.0)
    sink = MemorySink()
    with precisiondiff.capture(sink=sink, level="op", mode="tensors") as cap:
        a = x.sin()
        a.data = other
        a.cos()
    assert not cap.errors
    (cos,) = _ops(sink, "aten.cos.default")
    assert torch.equal(sink.tensor(_slot(cos, "input.0")), other)
