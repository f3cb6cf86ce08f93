"""Replay re-creates the layout each tensor argument had in the recorded call (strides, storage
offset, views of one storage), so a kernel with one path per layout replays the path the DUT ran."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from precisiondiff.bisect.isolate import UnitEvent
from precisiondiff.bisect.reuse import RoundedOps
from precisiondiff.capture import MemorySink, capture
from precisiondiff.capture.serialize import decode_call, encode_call


@torch.library.custom_op("pdlayout::two_path_mm", mutates_args=())
def two_path_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A planted GEMM with one path per layout of ``w``, as a vendor (or the portable bf16) GEMM
    may have: a transposed ``w`` (F.linear's ``weight.t()``) accumulates in float32, a contiguous
    one in bf16 chunks of 8. Both are deterministic; they round differently."""
    if w.stride(0) == 1 and w.shape[0] > 1:
        return (x.float() @ w.float()).to(x.dtype)
    acc = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype)
    for k in range(0, w.shape[0], 8):
        acc = acc + (x[:, k:k + 8].float() @ w[k:k + 8].float()).to(x.dtype)
    return acc


@two_path_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


class TwoPathLinear(nn.Module):
    def __init__(self, n_in: int = 64, n_out: int = 32):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / 8)

    def forward(self, x):
        return two_path_mm(x, self.weight.t())


def _strip_layouts(value):
    """The event's arguments as a dump of the previous format holds them (no layouts)."""
    if isinstance(value, list):
        return [_strip_layouts(v) for v in value]
    if isinstance(value, dict):
        return {k: _strip_layouts(v) for k, v in value.items() if k not in ("stride", "offset", "s")}
    return value


def _captured_call():
    torch.manual_seed(0)
    model = TwoPathLinear().bfloat16()
    sink = MemorySink()
    with capture(model=model, level="op", mode="replay", sink=sink):
        out = model(torch.randn(16, 64).bfloat16())
    ev = next(e for e in sink.events if e["name"] == "pdlayout.two_path_mm.default")
    slots = {t["slot"]: t for t in ev["tensors"]}
    return ev, (lambda s: sink.tensor(slots[s])), out


def test_a_replay_runs_the_kernel_path_of_the_recorded_layout():
    ev, tensor_of, out = _captured_call()
    assert ev["args"]["args"][1].get("stride") == [1, 64]
    args, kwargs = decode_call(ev["args"], tensor_of)
    assert args[1].stride() == (1, 64) and torch.equal(args[1], tensor_of("input.1"))
    assert torch.equal(two_path_mm(*args, **kwargs), out)
    # the same arguments as contiguous copies (what a replay did before layouts were recorded)
    old_args, old_kwargs = decode_call(_strip_layouts(ev["args"]), tensor_of)
    assert old_args[1].is_contiguous()
    assert not torch.equal(two_path_mm(*old_args, **old_kwargs), out)


def test_a_dump_on_disk_replays_with_its_layouts(tmp_path):
    import precisiondiff
    torch.manual_seed(0)
    model = TwoPathLinear().bfloat16()
    with capture(str(tmp_path / "d"), model=model, level="op", mode="replay"):
        out = model(torch.randn(16, 64).bfloat16())
    dump = precisiondiff.load(str(tmp_path / "d"))
    assert dump.meta["arg_layouts"] is True
    ev = next(e for e in dump.events() if e.name == "pdlayout.two_path_mm.default")
    keys = {t.slot: t.key for t in ev.tensors}
    args, kwargs = decode_call(ev.args, lambda s: dump.tensor(keys[s]))
    assert torch.equal(two_path_mm(*args, **kwargs), out)


def _encode(*tensors):
    slots = {id(t): f"input.{i}" for i, t in enumerate(tensors)}
    stored = {f"input.{i}": t.contiguous().clone() for i, t in enumerate(tensors)}
    return encode_call(list(tensors), {}, lambda t: slots[id(t)]), stored.__getitem__


def test_views_of_one_storage_are_views_of_one_buffer_again():
    qkv = torch.randn(4, 3 * 8)
    q, k, v = qkv.split(8, dim=1)
    enc, tensor_of = _encode(q, k, torch.randn(3))
    assert [a.get("s") for a in enc["args"]] == [0, 0, None]
    (q2, k2, other), _ = decode_call(enc, tensor_of)
    assert q2.untyped_storage().data_ptr() == k2.untyped_storage().data_ptr()
    assert k2.storage_offset() - q2.storage_offset() == 8 and q2.stride() == k2.stride() == (24, 1)
    assert torch.equal(q2, q) and torch.equal(k2, k) and other.is_contiguous()


def test_a_broadcast_argument_keeps_its_zero_stride():
    x = torch.randn(1, 5).expand(4, 5)
    enc, tensor_of = _encode(x)
    (y,), _ = decode_call(enc, tensor_of)
    assert y.stride() == (0, 1) and torch.equal(y, x)


def test_a_view_into_a_large_flat_buffer_does_not_allocate_the_buffer():
    flat = torch.randn(1_000_000)
    w = flat[900_000:900_064].view(8, 8).t()
    enc, tensor_of = _encode(w)
    assert enc["args"][0]["offset"] == 900_000
    (w2,), _ = decode_call(enc, tensor_of)
    assert w2.stride() == w.stride() and torch.equal(w2, w)
    assert w2.untyped_storage().nbytes() < 4 * 1024 and w2.storage_offset() % 64 == 900_000 % 64


_VIEWS = st.lists(st.sampled_from(["t", "slice", "step", "expand", "select", "narrow"]), max_size=4)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=3), views=_VIEWS, offset=st.integers(0, 70))
def test_any_strided_view_round_trips_with_its_layout(shape, views, offset):
    base = torch.randn(offset + torch.Size(shape).numel())
    t = base[offset:].view(shape)
    for view in views:
        if view == "t":
            t = t.transpose(0, -1)
        elif view == "slice" and t.shape[0] > 1:
            t = t[1:]
        elif view == "step":
            t = t[::2]
        elif view == "expand":
            t = t[:1].expand(3, *t.shape[1:])
        elif view == "select" and t.dim() > 1:
            t = t.select(-1, 0)
        elif view == "narrow" and t.shape[-1] > 1:
            t = t.narrow(-1, 1, t.shape[-1] - 1)
    enc, tensor_of = _encode(t)
    (back,), _ = decode_call(enc, tensor_of)
    assert back.shape == t.shape and torch.equal(back, t)
    if t.numel() > 0:
        assert back.stride() == t.stride()
        assert back.storage_offset() % 64 == t.storage_offset() % 64


def test_old_dump_entries_decode_as_before():
    enc = {"args": [{"t": "input.0"}, {"like": {"dtype": "float32", "shape": [2, 3]}}], "kwargs": {"dict": {}}}
    x = torch.randn(2, 3)
    (a, b), kwargs = decode_call(enc, {"input.0": x}.__getitem__)
    assert a is x and torch.equal(b, torch.zeros(2, 3)) and kwargs == {}


def _event(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, w_layout: dict) -> UnitEvent:
    tensors = {"input.0": x, "input.1": w.contiguous(), "output.0": out}
    slots = {s: (str(t.dtype).removeprefix("torch."), tuple(t.shape), True) for s, t in tensors.items()}
    args = {"replayable": True, "args": [{"t": "input.0"}, {"t": "input.1", **w_layout}], "kwargs": {"dict": {}}}
    return UnitEvent(0, "op", "", "aten.mm.default", "forward", 0, slots, args, tensors.__getitem__)


@pytest.mark.parametrize("recorded_transposed", [True, False])
def test_reuse_takes_a_recorded_output_only_for_the_recorded_layout(recorded_transposed):
    x = torch.randn(4, 8).bfloat16()
    w = (torch.randn(8, 8).bfloat16().t() if recorded_transposed else torch.randn(8, 8).bfloat16())
    golden = x.double() @ w.double()
    reuse = RoundedOps("cpu", torch.float64, torch.bfloat16)
    layout = {"stride": list(w.stride())} if not w.is_contiguous() else {}
    assert reuse.add(_event(x, w, golden.bfloat16(), layout), [golden], torch.ops.aten.mm.default)
    same = w.double().t().contiguous().t() if recorded_transposed else w.double()
    other = w.double().contiguous() if recorded_transposed else w.double().t().contiguous().t()
    assert same.stride() == w.stride() and other.stride() != w.stride()
    hit = reuse.lookup("aten.mm.default", (x.double(), same), {})
    assert hit is not None and torch.equal(hit, golden.bfloat16().double())
    assert reuse.lookup("aten.mm.default", (x.double(), other), {}) is None
