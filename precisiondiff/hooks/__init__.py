"""Capture: module hooks, the op dispatch mode, scopes, filters and the capture session."""
from .filters import CaptureFilter, parse_selection
from .recorder import MemorySink, Recorder, make_key
from .session import LEVELS, CaptureSession, capture

__all__ = ["CaptureFilter", "parse_selection", "MemorySink", "Recorder", "make_key", "LEVELS",
           "CaptureSession", "capture"]
