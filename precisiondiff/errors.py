"""Exceptions a user can fix. Anything else escaping precisiondiff is a bug.

The CLI turns a :class:`PrecisionDiffError` into a one-line message and exit code 2.
"""
from __future__ import annotations

__all__ = [
    "PrecisionDiffError",
    "TargetError",
    "WorkloadError",
    "DumpError",
    "CaptureError",
    "AlignmentError",
    "BisectError",
]


class PrecisionDiffError(Exception):
    """Base class: bad input or usage that the user can correct."""


class TargetError(PrecisionDiffError):
    """A target string is malformed, or its device is not available."""


class WorkloadError(PrecisionDiffError):
    """A workload spec cannot be loaded or its function returns the wrong thing."""


class DumpError(PrecisionDiffError):
    """A dump is missing, unreadable, corrupted or cannot be written."""


class CaptureError(PrecisionDiffError):
    """Capture could not proceed (e.g. the disk filled up)."""


class AlignmentError(PrecisionDiffError):
    """Two dumps cannot be compared (different models, steps or ranks)."""


class BisectError(PrecisionDiffError):
    """Bisect cannot run on the given inputs."""
