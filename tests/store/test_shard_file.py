"""Shards are read with plain file reads (store/shard_file.py), byte for byte what safetensors'
memory-mapped reader gives, for every dtype a dump holds."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from precisiondiff.store.shard_file import DTYPES, ShardFile


@settings(max_examples=40, deadline=None)
@given(dtypes=st.lists(st.sampled_from(sorted(DTYPES)), min_size=1, max_size=5),
       shapes=st.lists(st.lists(st.integers(0, 7), max_size=3), min_size=5, max_size=5), seed=st.integers(0, 999))
def test_a_shard_reads_as_safetensors_reads_it(tmp_path_factory, dtypes, shapes, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, name in enumerate(dtypes):
        raw = torch.randint(0, 256, (max(1, torch.Size(shapes[i]).numel()) * DTYPES[name].itemsize,),
                            dtype=torch.uint8, generator=g)
        t = raw.view(DTYPES[name])[:torch.Size(shapes[i]).numel()].reshape(shapes[i])
        tensors[f"t{i}/{name}"] = t.clone()
    path = tmp_path_factory.mktemp("shard") / "s.safetensors"
    save_file(tensors, str(path), metadata={"by": "test"})
    shard, reference = ShardFile(path), safe_open(str(path), framework="pt")
    assert sorted(shard.keys()) == sorted(tensors)
    for key in tensors:
        got, want = shard.get_tensor(key), reference.get_tensor(key)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.reshape(-1).view(torch.uint8).equal(want.reshape(-1).view(torch.uint8))
    shard.close()


def test_a_damaged_shard_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file({"a": torch.arange(10.0)}, str(path))
    data = path.read_bytes()
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match="header"):
        ShardFile(tmp_path / "bad.safetensors")
    (tmp_path / "short.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="ends after"):
        ShardFile(tmp_path / "short.safetensors").get_tensor("a")
