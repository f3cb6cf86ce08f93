"""schema: keys, dtype names, Event JSON round trip."""
from __future__ import annotations

import pytest
import torch

from precisiondiff.store import Event, TensorRecord, tensor_key
from precisiondiff.store.schema import dtype_from_name, dtype_name, is_shard_name, shard_name


def test_tensor_key():
    assert tensor_key("blocks.2.attn", "aten.addmm.default", 0, "forward", "output.0") == \
        "blocks.2.attn/aten.addmm.default#0:forward:output.0"
    assert tensor_key("", "TinyTransformer", 1, "backward", "grad_input.0", step=3,
                      multi_step=True) == "step3//TinyTransformer#1:backward:grad_input.0"
    with pytest.raises(ValueError):
        tensor_key("a", "b", 0, "forward", "output.0", multi_step=True)


def test_dtype_names():
    for d in (torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool):
        assert dtype_from_name(dtype_name(d)) is d
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    assert dtype_from_name("torch.float16") is torch.float16
    with pytest.raises(ValueError):
        dtype_from_name("Tensor")


def test_shard_names():
    assert shard_name(0) == "shard-00000.safetensors"
    assert is_shard_name("shard-00012.safetensors")
    assert not is_shard_name("shard-00012.safetensors.tmp") and not is_shard_name("shard-.safetensors")


def test_event_round_trip():
    rec = TensorRecord("s/n#0:forward:output.0", "output.0", "bfloat16", (2, 3),
                       {"max": 1.0, "nan": 0}, "s/n#0:forward:output.0", "shard-00000.safetensors")
    alias = TensorRecord("t/m#0:forward:input.0", "input.0", "bfloat16", (2, 3), {},
                         "s/n#0:forward:output.0", "shard-00000.safetensors")
    stats_only = TensorRecord("x", "output.0", "float32", (), {})
    ev = Event(4, 1, 0, "op", "s", "n", "forward", 0, "cpu", [rec, alias, stats_only], {"dim": 1})
    back = Event.from_json(ev.to_json())
    assert back == ev
    assert rec.has_data and not rec.is_alias and alias.is_alias and not stats_only.has_data
    assert Event.from_json(ev.to_dict()) == ev


def test_conversion_fields_round_trip_and_stay_absent_when_unset():
    held = TensorRecord("k", "output.0", "float64", (2,), {"max": 1.0}, held_dtype="float32")
    wide = TensorRecord("j", "input.0", "int64", (2,), {"min": 0.0, "max": 3e9},
                        int32_overflow={"min": 0.0, "max": 3e9})
    plain = TensorRecord("i", "input.1", "int64", (2,), {})
    for rec in (held, wide, plain):
        assert TensorRecord.from_dict(rec.to_dict()) == rec
    assert "held_dtype" not in plain.to_dict() and "int32_overflow" not in plain.to_dict()
    assert TensorRecord.from_dict({"key": "k", "dtype": "float64", "shape": [2]}).held_dtype is None


def test_event_from_json_errors():
    with pytest.raises(ValueError):
        Event.from_json("[1, 2]")
    with pytest.raises(ValueError):
        Event.from_json('{"seq": 0}')
