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


class StreamSet:
    """The streams tensors were recorded on since the last :meth:`join`, per device."""

    def __init__(self) -> None:
        self._streams: Dict[Tuple[torch.device, Any], Any] = {}

    def note(self, device: torch.device) -> None:
        """Remember ``device``'s current stream (call for non-CPU tensors only)."""
        module = _module(device)
        if module is None or not hasattr(module, "current_stream"):
            return
        stream = module.current_stream(device)
        self._streams.setdefault((device, getattr(stream, "stream_id", id(stream))), stream)

    def join(self) -> None:
        """Make each device's current stream wait for the streams noted on it; forget them."""
        for (device, _), stream in self._streams.items():
            current = _module(device).current_stream(device)
            if current != stream:
                current.wait_stream(stream)
        self._streams.clear()
