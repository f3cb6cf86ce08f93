"""Property: every supported dtype, shape and layout round-trips bit for bit, both formats."""
from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precisiondiff.store import DumpWriter, load, verify

from .helpers import assert_bitwise_equal, op_event

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int64, torch.int32, torch.bool]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_counter = itertools.count()


@st.composite
def tensors(draw):
    """Random bit patterns (NaNs, infinities, -0 included) in random layouts."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    base_shape = shape + (2,) if layout == "sliced" else shape
    n = 1
    for s in base_shape:
        n *= s
    if dtype == torch.bool:
        base = torch.randint(0, 2, (n,), generator=gen).bool()
    else:
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(-2**62, 2**62, (n,), generator=gen, dtype=torch.int64)
        base = raw.to(_INT_VIEW[size]).view(dtype)
    base = base.reshape(base_shape)
    if layout == "sliced":
        return base[..., 1]
    if layout == "transposed" and len(shape) >= 2:
        return base.reshape(shape[::-1]).transpose(0, -1) if len(shape) == 2 else base.mT
    return base


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(tensors(), min_size=1, max_size=6),
       fmt=st.sampled_from(["safetensors", "h5"]), shard_bytes=st.sampled_from([1, 64, 1 << 20]))
def test_tensors_round_trip_bitwise(tmp_path, batch, fmt, shard_bytes):
    path = tmp_path / f"dump{next(_counter)}"
    with DumpWriter(path, format=fmt, meta={}, shard_bytes=shard_bytes) as w:
        for i, t in enumerate(batch):
            w.write_event(*op_event(i, [("output.0", t)]))
    dump = load(path)
    events = list(dump.events())
    assert [e.seq for e in events] == list(range(len(batch)))
    for ev, want in zip(events, batch):
        (rec,) = ev.tensors
        assert rec.dtype == str(want.dtype).split(".")[1]
        assert rec.shape == tuple(want.shape)
        assert_bitwise_equal(dump.tensor(rec.key), want)
    dump.close()
    assert verify(path).ok
