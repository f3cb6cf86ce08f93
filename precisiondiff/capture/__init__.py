"""Capture: module hooks, the op dispatch mode, scopes, filters, statistics and the capture session.

Stage 1 of capture -> store -> compare -> bisect. May import runtime/, store/ and comparators/;
never compare/, bisect/, report/ or the faces. ``precisiondiff.capture(...)`` calls
:func:`capture` (the package is callable, see ``_callable.py``).
"""
from .filters import CaptureFilter, parse_selection
from .recorder import MemorySink, Recorder, make_key
from .session import LEVELS, CaptureSession, capture

__all__ = ["CaptureFilter", "parse_selection", "MemorySink", "Recorder", "make_key", "LEVELS",
           "CaptureSession", "capture"]

from .._callable import make_callable  # noqa: E402

make_callable(__name__, "capture")
