"""The dump sink: events from a capture into a :class:`~precisiondiff.store.DumpWriter`."""
from __future__ import annotations

import os
import socket
import sys
from typing import Dict

import torch

__all__ = ["DumpSink", "base_meta"]


def base_meta() -> dict:
    """Provenance every dump records: versions, host, command line."""
    meta = {"torch": torch.__version__, "host": socket.gethostname(), "argv": list(sys.argv),
            "pid": os.getpid()}
    mlu = sys.modules.get("torch_mlu")
    meta["torch_mlu"] = getattr(mlu, "__version__", None) if mlu else None
    from .. import __version__
    meta["precisiondiff"] = __version__
    from ..runtime.float32_switches import float32_switches
    meta["float32_switches"] = float32_switches()  # TF32: bisect says when a float32 DUT ran with it
    return meta


class DumpSink:
    """Writes events and tensors through the store's writer."""

    def __init__(self, path: "str | os.PathLike", *, format: str, meta: dict, overwrite: bool = False,
                 durable: bool = False, **limits: int) -> None:
        from ..store import DumpWriter
        self.writer = DumpWriter(path, format=format, meta={**base_meta(), **meta}, overwrite=overwrite,
                                 durable=durable, **limits)

    def update_meta(self, **fields: object) -> None:
        """Fields for meta.json, written when the dump is closed."""
        self.writer.update_meta(**fields)

    def write_event(self, event: dict, data: Dict[str, torch.Tensor]) -> None:
        self.writer.write_event(event, data)

    def write_events(self, items: list) -> None:
        """A batch of ``(event, data)``: one hand-off to the writer thread."""
        self.writer.write_events(items)

    def flush(self) -> None:
        """Put every event so far on disk (a shard and its index lines)."""
        self.writer.flush()

    def close(self, complete: bool = True) -> None:
        self.writer.close(complete=complete)
