"""The dump format: write (async, atomic), read (lazy, memory-mapped), verify.

See docs/dump-format.md for the layout on disk.

Stage 2 of capture -> store -> compare -> bisect. Imports torch, safetensors, h5py and errors
only; the tensor key is built here alone (:func:`schema.tensor_key`).
"""
from __future__ import annotations

from .fingerprint import fingerprint, fingerprint_hex, fingerprint_tensor
from .reader import Dump, load
from .schema import FORMAT_VERSION, Event, TensorRecord, tensor_key
from .verify import VerifyReport, verify
from .writer import DumpWriter

__all__ = [
    "load",
    "Dump",
    "Event",
    "TensorRecord",
    "DumpWriter",
    "verify",
    "VerifyReport",
    "fingerprint",
    "fingerprint_tensor",
    "fingerprint_hex",
    "tensor_key",
    "FORMAT_VERSION",
]
