"""A safetensors shard read with plain file reads, not through a memory map.

``safetensors.safe_open`` maps the shard and hands out tensors backed by the mapping: every page a
read touched stays in the process's resident set until the handle is closed. Bisect reads the
tensors of one unit at a time from dumps of tens of GiB, with up to 32 shards open: its resident set
grew with the dump (17.9 GiB at 853 M parameters, sequence 256, of which ~10 GiB mapped shard pages;
docs/performance.md, "Scale"). Here each tensor is read into its own memory, freed with it.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
the JSON header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets from the
end of the header), then the data. Nothing is unpickled.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Tuple

import torch

__all__ = ["ShardFile", "DTYPES"]

#: safetensors dtype names -> torch dtypes (those absent from this PyTorch are left out)
DTYPES: Dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("C64", "complex64")) if hasattr(torch, attr)}


class ShardFile:
    """One open shard: its header parsed once, each tensor read on demand.

    Args:
        path: the ``.safetensors`` file.

    Raises:
        ValueError: the header is not a safetensors header (a damaged shard).
    """

    def __init__(self, path: "str | Path") -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 - held open; closed by close()/__del__
        try:
            (length,) = struct.unpack("<Q", self._file.read(8))
            size = self.path.stat().st_size
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(self._file.read(length))
        except Exception:
            self._file.close()
            raise
        self._start = 8 + length
        self._entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, which this PyTorch lacks")
            begin, end = info["data_offsets"]
            self._entries[name] = (dtype, tuple(int(d) for d in info["shape"]), int(begin), int(end))

    def keys(self) -> "list[str]":
        """The tensor names in the shard."""
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in memory of its own (CPU).

        Raises:
            KeyError: no such tensor.
            ValueError: its data does not fit its dtype and shape, or the file ends early.
        """
        dtype, shape, begin, end = self._entries[name]
        out = torch.empty(shape, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if nbytes != end - begin:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for {dtype} {list(shape)}")
        if nbytes:
            self._file.seek(self._start + begin)
            got = self._file.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
            if got != nbytes:
                raise ValueError(f"tensor {name!r}: the file ends after {got} of {nbytes} bytes")
        return out

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __del__(self) -> None:
        try:
            self._file.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
