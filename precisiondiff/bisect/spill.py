"""The captured DUT step within a host-memory budget: tensors beyond it go to a temporary directory.

Bisect keeps the one captured step (``--mode replay``: every recorded op's inputs and outputs) for
the whole search. :class:`SpillSink` holds tensor data in memory up to ``budget`` bytes and writes
the rest, one raw file per tensor (bytes only: nothing is pickled), to a private temporary
directory, read back on demand; the directory is removed by :meth:`SpillSink.cleanup`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..capture import MemorySink

__all__ = ["SpillSink", "DEFAULT_BUDGET"]

DEFAULT_BUDGET = 2 << 30  # bytes of the captured step held in memory (docs/bisect.md, "Host memory")


class SpillSink(MemorySink):
    """A :class:`~precisiondiff.capture.MemorySink` that keeps at most ``budget`` bytes of tensor
    data in memory and spills the rest to disk.

    Attributes:
        held_bytes: bytes of tensor data in memory.
        spilled_bytes: bytes written to disk (``spilled`` tensors).
    """

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        super().__init__()
        self.budget = int(budget)
        self.held_bytes = 0
        self.spilled_bytes = 0
        self.spilled = 0
        self._files: Dict[str, Tuple[str, torch.dtype, Tuple[int, ...]]] = {}
        self._dir: Optional[str] = None

    def write_event(self, event: dict, data: Dict[str, torch.Tensor]) -> None:  # noqa: D102
        self.events.append(event)
        for key, tensor in data.items():
            if key in self.data or key in self._files:
                continue
            t = tensor.detach()
            size = t.numel() * t.element_size()
            if self.held_bytes + size <= self.budget:
                self.data[key] = t
                self.held_bytes += size
                continue
            self._spill(key, t)
            self.spilled_bytes += size
            self.spilled += 1

    def _spill(self, key: str, t: torch.Tensor) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="precisiondiff-bisect-")
            # removed with the sink even when the bisect is interrupted by an error
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        path = os.path.join(self._dir, f"{len(self._files)}.bin")
        t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tofile(path)
        self._files[key] = (path, t.dtype, tuple(t.shape))

    def tensor(self, record: dict) -> torch.Tensor:
        """The stored data of a tensor record, from memory or read back from disk."""
        key = record["data_key"]
        found = self.data.get(key)
        if found is not None:
            return found
        path, dtype, shape = self._files[key]
        raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        return raw.view(dtype).reshape(shape)

    def cleanup(self) -> None:
        """Remove the spilled files."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._files.clear()
