"""Which DTensor shard a plain tensor of a multi-rank dump is (compare/shards.py, ``ShardLayout``):
the one shard of the same content, dtype and shape; not resolved when shards of different
layouts share that content (which one it is cannot be told)."""
from __future__ import annotations

import json
from types import SimpleNamespace

from precisiondiff.compare.shards import ShardLayout


def _rec(key, fingerprint, **fields):
    return {"key": key, "slot": key.rsplit(":", 1)[-1], "dtype": "bfloat16", "shape": [2, 8, 32],
            "stats": {"fingerprint": fingerprint}, **fields}


def _layout(tmp_path, records):
    (tmp_path / "index.jsonl").write_text("".join(
        json.dumps({"seq": i, "kind": "module", "scope": "m", "name": "M", "direction": "backward",
                    "tensors": [rec]}) + "\n" for i, rec in enumerate(records)))
    return ShardLayout(SimpleNamespace(ranks={0: SimpleNamespace(path=tmp_path)}))


def test_a_plain_tensor_takes_the_placements_of_the_one_shard_of_its_content(tmp_path):
    seq = {"placements": ["S(1)"], "global_shape": [2, 16, 32], "mesh": [0, 1], "mesh_shape": [2]}
    layout = _layout(tmp_path, [_rec("a:output.0", "f1", **seq), _rec("b:grad_input.0", "f1"),
                                _rec("c:grad_input.0", "f2")])
    assert layout.fields(0, "b:grad_input.0")["placements"] == ["S(1)"]
    assert layout.fields(0, "b:grad_input.0")["inferred_from"] == "a:output.0"
    assert layout.fields(0, "c:grad_input.0") is None and layout.ambiguous(0, "c:grad_input.0") is None


def test_shards_of_different_layouts_with_its_content_leave_it_unresolved(tmp_path):
    seq = {"placements": ["S(1)"], "global_shape": [2, 16, 32], "mesh": [0, 1], "mesh_shape": [2]}
    batch = {"placements": ["S(0)"], "global_shape": [4, 8, 32], "mesh": [0, 1], "mesh_shape": [2]}
    layout = _layout(tmp_path, [_rec("a:output.0", "zeros", **seq), _rec("b:output.0", "zeros", **batch),
                                _rec("c:grad_input.0", "zeros")])
    assert layout.fields(0, "c:grad_input.0") is None
    assert layout.ambiguous(0, "c:grad_input.0") == ["a:output.0", "b:output.0"]
    assert layout.fields(0, "a:output.0")["placements"] == ["S(1)"]  # recorded shards keep their own
