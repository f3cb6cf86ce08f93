"""Stream safety of capture on accelerators, device-generic (``torch.get_device_module``).

Statistics and host copies are issued on the stream current when a tensor is recorded: the
stream its op ran on (a collective's communication stream is ordered before by waiting on its
work). A batch read-back may run later on another current stream (the user switched streams
with ``torch.cuda.stream(s)`` between ops), so before reading back, the current stream waits
for every stream a tensor of the batch was recorded on. The read-back itself copies to the
host synchronously, so buffers freed after it are no longer in use on any stream.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

__all__ = ["StreamSet"]


def _module(device: torch.device) -> Any:
    try:
        return torch.get_device_module(device.type)
    except (AttributeError, RuntimeError):
        return None


def _raw_query(device_type: str) -> Any:
    """The backend's cheap current-stream query, ``fn(device_index) -> int`` (CUDA's
    ``torch._C._cuda_getCurrentRawStream``, what inductor's generated code calls), or None.
    ``current_stream`` builds a Stream object each call (8.5 us on an H200 host, per recorded
    tensor); the raw handle tells whether the stream is one already noted in ~1 us."""
    return getattr(torch._C, f"_{device_type}_getCurrentRawStream", None)


class StreamSet:
    """The streams tensors were recorded on since the last :meth:`join`, per device."""

    def __init__(self) -> None:
        self._streams: Dict[Tuple[torch.device, Any], Any] = {}
        self._raw: Dict[str, Any] = {}  # device type -> its raw query, or None
        self._seen: set = set()  # (device, raw handle) whose stream is in _streams

    def note(self, device: torch.device) -> None:
        """Remember ``device``'s current stream (call for non-CPU tensors only)."""
        kind = device.type
        raw = self._raw.get(kind, False)
        if raw is False:
            raw = self._raw[kind] = _raw_query(kind)
        seen = None
        if raw is not None and device.index is not None:
            try:
                seen = (device, raw(device.index))
            except (RuntimeError, TypeError):
                self._raw[kind] = None
            if seen is not None and seen in self._seen:
                return
        module = _module(device)
        if module is None or not hasattr(module, "current_stream"):
            return
        stream = module.current_stream(device)
        self._streams.setdefault((device, getattr(stream, "stream_id", id(stream))), stream)
        if seen is not None:
            self._seen.add(seen)

    def join(self) -> None:
        """Make each device's current stream wait for the streams noted on it; forget them."""
        for (device, _), stream in self._streams.items():
            current = _module(device).current_stream(device)
            if current != stream:
                current.wait_stream(stream)
        self._streams.clear()
        self._seen.clear()
